"""An acco update's lower bound on time from ddp's compute C and comm M per update, for every
variant of acco (the estimate round in full or int8, the update's micro-batches split evenly, e of
2k, or by the rounds' durations): :func:`acco_update_time`, the one formula that
``acco-bench cluster`` (:func:`acco_bench.analysis.add_comparisons`) and ``acco-bench map``
(:mod:`acco_bench.map`) both use, and :func:`acco_spec`, its arguments read from the Hydra overrides
an acco worker runs with (``BenchSettings.overrides``: the variant's, then the run's ``--override``s)."""

from __future__ import annotations

from pathlib import Path

from acco_bench import BenchError
from acco_bench.settings import BenchSettings, base_method

INT8_BLOCK = 2048  # acco/engine/quantize.py: int8 elements + one fp32 scale per block of 2048


def int8_ratio(elem_bytes: int) -> float:
    """Bytes of the int8 estimate round over the full round's: 1 byte per element + a 4-byte scale
    per 2048-element block, against ``elem_bytes`` (4 in fp32, 2 in bf16)."""
    return (1 + 4 / INT8_BLOCK) / elem_bytes


def acco_update_time(
    c: float,
    m: float,
    *,
    elem_bytes: int = 4,
    latency_s: float = 0.0,
    estimate_comm: str = "full",
    split: int | str | None = None,
    micro_batches: int | None = None,
    accumulate: bool = False,
) -> float:
    """Lower bound on an acco update's seconds from ddp's compute ``c`` and comm ``m`` per update.

    The update runs two rounds, each hiding the micro-batches computed meanwhile: the estimate round
    (M_est = M, or with ``estimate_comm`` int8 ``int8_ratio(elem_bytes)`` of M's bandwidth part plus
    ``latency_s``, the part of M that does not shrink) and the update round (M). ``split``: the
    micro-batches computed during the estimate round, e of ``micro_batches`` = 2k per worker per
    update (estimate_micro_batches): max(e C/2k, M_est) + max((2k-e) C/2k, M); None: the even split,
    max(C/2, M_est) + max(C/2, M) (max(C, 2M) with a full estimate round); "auto": split by the
    rounds' durations, max(C, M_est + M). ``accumulate``: workers compute while a round runs, the
    samples/s bound is compute alone, C."""
    if accumulate:
        return c
    m_est = m
    if estimate_comm == "int8":
        m_est = int8_ratio(elem_bytes) * (m - latency_s) + latency_s
    elif estimate_comm != "full":
        raise BenchError(f"estimate_comm must be full or int8, got {estimate_comm!r}")
    if split == "auto":
        return max(c, m_est + m)
    if split is None:
        return max(c / 2, m_est) + max(c / 2, m)
    if (
        isinstance(split, bool)
        or not isinstance(split, int)
        or not micro_batches
        or not 1 <= split < micro_batches
    ):
        raise BenchError(f"estimate_micro_batches must be auto, null or e in [1, 2k - 1] of the 2k = "
                         f"{micro_batches} micro-batches per update, got {split!r}")
    share = split / micro_batches  # e / 2k of the update's compute runs under the estimate round
    return max(share * c, m_est) + max((1 - share) * c, m)


def acco_formula(spec: dict) -> tuple[str, str]:
    """(the bound's formula, its terms) for an ``acco_spec``: what the reports print."""
    if spec.get("accumulate"):
        return "(C+M)/C", "samples/s, compute never waits"
    est = "M_est" if spec.get("estimate_comm") == "int8" else "M"
    terms = f"M_est = {int8_ratio(spec.get('elem_bytes', 4)):.4g} M" if est == "M_est" else ""
    split = spec.get("split")
    if split == "auto":
        f = "(C+M)/max(C,2M)" if est == "M" else "(C+M)/max(C, M_est+M)"
        terms = ", ".join(x for x in ("split by the rounds' durations", terms) if x)
    elif split is None:
        f = "(C+M)/max(C,2M)" if est == "M" else "(C+M)/(max(C/2, M_est)+max(C/2, M))"
    else:
        f = f"(C+M)/(max(eC/2k, {est})+max((2k-e)C/2k, M))"
        terms = ", ".join(x for x in (f"e = {split}, 2k = {spec.get('micro_batches')}", terms) if x)
    return f, terms


def acco_spec(overrides) -> dict:
    """``acco_update_time``'s arguments (but C, M, latency) from an acco worker's Hydra overrides,
    composed as the worker composes them (``acco.config.compose``): estimate_comm,
    estimate_micro_batches (the split), n_grad_accumulation (k per round: 2k per update),
    use_mixed_precision (bf16 on the wire: 2 bytes per element, else 4), accumulate_while_waiting."""
    from acco.config import compose

    t = compose(list(overrides)).train
    return {"estimate_comm": t.estimate_comm, "split": t.estimate_micro_batches,
            "micro_batches": 2 * int(t.n_grad_accumulation), "elem_bytes": 2 if t.use_mixed_precision else 4,
            "accumulate": bool(t.accumulate_while_waiting)}


def bench_settings(cfg: dict) -> BenchSettings:
    """The settings of a bench.json / sweep.json ``config`` (``BenchSettings.describe``)."""
    s = BenchSettings(**{k: v for k, v in cfg.items() if k in BenchSettings.__dataclass_fields__})
    s.methods = tuple(s.methods)
    return s


def method_acco_spec(settings: BenchSettings, method: str) -> dict | None:
    """An acco method's (or variant's) ``acco_spec``, from the overrides its workers get; None otherwise."""
    if base_method(method) != "acco":
        return None
    return acco_spec(settings.overrides(method, Path("."), 0))
