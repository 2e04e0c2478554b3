"""Hydra configs of acco (``python main.py train=... model=... data=...``).

Importing this package (Hydra does, before it composes) registers what the YAML files need:

- the schema ``acco_schema`` (acco/config.py), the first entry of config.yaml's defaults;
- ``${acco.pretrained_or:${.pretrained},DEFAULT}`` in a model config: the pretrained model's own
  folder or hub name when ``model.pretrained`` is set (its tokenizer goes with its weights), else
  DEFAULT.
"""

from omegaconf import OmegaConf

from acco.config import register_schema

OmegaConf.register_new_resolver(
    "acco.pretrained_or", lambda pretrained, default: pretrained if pretrained else default, replace=True
)
register_schema()
