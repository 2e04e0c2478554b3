"""Hydra configs of acco (``python main.py train=... model=... data=...``).

``${acco.pretrained_or:${.pretrained},DEFAULT}`` in a model config: the pretrained model's own
folder or hub name when ``model.pretrained`` is set (its tokenizer goes with its weights), else
DEFAULT. Registered here because Hydra imports this package before it composes the configs.
"""

from omegaconf import OmegaConf

OmegaConf.register_new_resolver(
    "acco.pretrained_or", lambda pretrained, default: pretrained if pretrained else default, replace=True
)
