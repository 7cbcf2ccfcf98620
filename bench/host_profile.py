"""Where the host's time goes in one call: Python's own profiler (``cProfile``) per function.

Where a GPU step is host-bound (a decoding step at batch 1, a deep narrow model at micro batch 1)
its time is the Python and dispatching that queue its kernels, which ``torch.profiler``'s operator
table does not name (TransformerEngine's and megatron's Python, LIMe's bookkeeping, Triton's
launcher).  ``function_times`` runs a call under ``cProfile`` and keeps, per function, its
cumulative seconds (itself and what it called), its own seconds and its calls;
``function_differences`` lines two models' up, as ``bench_lime_overhead.kernel_differences`` does
for kernels.  cProfile slows Python-heavy code by a similar factor in both models, so read the
differences and the ranking, not the absolute times.  On Python 3.12 (the GPU image's) with
megatron-core 0.19 the profiler does not see every frame: the generation loop, ``decode_step`` and
the model's forward around the layers are missing or their calls miscounted (a decoder block's
forward once in four tokens), while the layers' functions and everything inside them are counted
in full (16 calls of each layer function a token at 16 layers); read the layers' rows.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from pathlib import PurePath

FunctionTimes = dict[str, tuple[float, float, int]]
"""Per function (``module.py:line(name)``): cumulative seconds, own seconds, calls."""


def function_times(run: Callable[[], object]) -> FunctionTimes:
    """``run()`` under ``cProfile``; each function's figures (see ``FunctionTimes``)."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    times: FunctionTimes = {}
    for (filename, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        label = f"{'/'.join(PurePath(filename).parts[-2:])}:{line}({name})" if line else name
        times[label] = (cumulative, own, calls)
    return times


def function_differences(
    lime: FunctionTimes, base: FunctionTimes, top: int, per: float = 1.0, by: str = "diff_ms"
) -> list[dict]:
    """The ``top`` functions with the largest ``by`` (``diff_ms``: LIMe's cumulative ms minus the
    baseline's; ``base_ms``: the baseline's own cumulative ms), largest first, every time divided
    by ``per`` (e.g. the tokens a generation made: ms per token); a function one model never
    called at 0 there."""
    entries = []
    for name in lime | base:
        lime_s, lime_own, lime_calls = lime.get(name, (0.0, 0.0, 0))
        base_s, base_own, base_calls = base.get(name, (0.0, 0.0, 0))
        entries.append(
            dict(
                name=name,
                lime_ms=1e3 * lime_s / per,
                base_ms=1e3 * base_s / per,
                diff_ms=1e3 * (lime_s - base_s) / per,
                lime_own_ms=1e3 * lime_own / per,
                base_own_ms=1e3 * base_own / per,
                lime_calls=lime_calls / per,
                base_calls=base_calls / per,
            )
        )
    return sorted(entries, key=lambda entry: entry[by], reverse=True)[:top]
