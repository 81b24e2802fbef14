"""Per-machine choice of how each fp32 projection runs: the tiled kernel with which register
tile, cache blocking and prefetch distance, or MKL, per weight shape and row range.

The compiled kernels are built per ISA, not per CPU: two AVX2 machines differ in registers in
flight, L2 (512 KB - 2 MB a core), L3 and memory bandwidth, and MKL's own speed differs by CPU.
So on first use on a machine the candidates are timed on the model's shapes and the winners
cached under ``~/.cache/kvforge/tune`` (or ``$KVFORGE_CACHE_DIR/tune``), keyed by CPU model,
torch version, kernel build and thread count; a shape not in the cache is tuned when a model
first brings it. ``kvforge tune`` tunes again; ``KVFORGE_TUNE=0`` skips tuning (the build's
defaults and ``LINEAR_ROWS_MAX`` then decide). An engine under a memory budget (offloading)
installs cached choices only: the timing's cold copies would not fit its budget.

Per shape [out, in] and row point r (1 .. few-rows, then powers of two; a point serves the rows
above the previous one), the search is staged so it takes seconds, not minutes:

    1. register tiles (the build default + the three with the fewest loads per FMA that fit
       the register file) and MKL (the form the Python layers use at r rows)
    2. from 32 rows: the best tile with x rows blocked to half of L2, and with K blocked to
       half of L1
    3. up to 32 rows (memory-bound: W streams from memory): the best so far with the W
       prefetch 0 or 4 tiles ahead instead of 2

Weights are timed cold (a rotation of copies a few times L3), as a decode step streams them.
A candidate replaces the default only when the median of its same-round time ratios beats it
by WIN_MARGIN, so a shared machine's preemptions do not make the choice.

Every candidate's product is compared with ``F.linear`` before it may win. Tile shape, row
blocking and prefetch do not change any output's arithmetic (each output is the same sequence
of vector FMAs and one horizontal sum), so the tuner cannot change greedy tokens through them;
a K split or MKL rounds differently, like the kernel / MKL switch always has.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kvforge.kernels import _build_dir, cpu_kernels, kernels_enabled
from kvforge.kernels.isa import cpu_model_name, selected_isa

logger = logging.getLogger(__name__)

ENV_VAR = "KVFORGE_TUNE"
CACHE_VERSION = 2
MAX_TUNED_ROWS = 256        # more rows (long prefill chunks) run MKL
TIMED_OUT_MAX = 4096        # columns a wide weight (an LM head) is timed on: a slice, same tiles
# a candidate replaces the build's default (and MKL the tiled kernel) only when this much
# faster: a choice within timing noise would flip from one start to the next
WIN_MARGIN = 0.03
# stage 2 (cache blocking) from this many rows (x fits L2 below), stage 3 (prefetch distance)
# up to this many (more rows: compute-bound, W is reused from cache)
BLOCKING_ROWS_MIN = 32
PREFETCH_ROWS_MAX = 32
STAGE_BUDGET_S = 0.02       # timed calls per stage: about this long in all, 3 to 15 per candidate


def tuning_enabled() -> bool:
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value in ("0", "off", "false", "no"):
        return False
    if value in ("", "1", "on", "true", "yes"):
        return True
    raise ValueError(f"{ENV_VAR}={value!r}: use 1 or 0")


@dataclass(frozen=True, slots=True)
class Plan:
    """One way to run x [rows, in] @ W[out, in]^T. kind "tiled": linear.cpp's kernel with this
    tile / blocking / prefetch (0 or -1: the build's default); kind "mkl": ``mkl_linear``."""
    kind: str
    tile_m: int = 0
    tile_n: int = 0
    block_k: int = 0
    block_m: int = 0
    prefetch_tiles: int = -1

    def __post_init__(self) -> None:
        if self.kind not in ("tiled", "mkl"):
            raise ValueError(f"plan kind must be 'tiled' or 'mkl', got {self.kind!r}")
        if not (0 <= self.tile_m <= 8 and 0 <= self.tile_n <= 8):
            raise ValueError(f"tile {self.tile_m} x {self.tile_n} outside 0..8")

    def label(self) -> str:
        if self.kind == "mkl":
            return "MKL"
        text = f"tile {self.tile_m}x{self.tile_n}"
        if self.block_m:
            text += f" rows/{self.block_m}"
        if self.block_k:
            text += f" K/{self.block_k}"
        if self.prefetch_tiles >= 0:
            text += f" pf{self.prefetch_tiles}"
        return text

    def run(self, ops, x: torch.Tensor, weight: torch.Tensor, packed_out: int) -> torch.Tensor:
        """y for x with ``weight`` row-major (packed_out < 0) or packed for ``packed_out`` rows."""
        if self.kind == "mkl":
            dense = (weight if packed_out < 0 else
                     _unpack(weight, packed_out))
            return mkl_linear(x, dense)
        return ops.linear_with_plan(x, weight, packed_out, self.tile_m, self.tile_n,
                                    self.block_k, self.block_m, self.prefetch_tiles)


def _unpack(packed: torch.Tensor, out: int) -> torch.Tensor:
    from kvforge.kernels.ops import unpack_linear_weight
    return unpack_linear_weight(packed, out)


W_FIRST_MAX = 128   # up to here MKL runs fastest as W @ x^T (layers/linear.py)


def mkl_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W^T in the MKL form fastest for its rows: for 1 row [x; x] (the 2-column GEMM reads
    W ~2x faster than MKL's gemv), ``W @ x^T`` up to ``W_FIRST_MAX`` rows, then ``F.linear``."""
    rows = x.shape[0]
    if rows == 1:
        return torch.mm(weight, x.expand(2, -1).contiguous().t())[:, 0].contiguous()[None]
    if rows <= W_FIRST_MAX:
        return torch.mm(weight, x.t()).t().contiguous()
    return F.linear(x, weight)


@dataclass(slots=True)
class PointChoice:
    """The winner for rows in (previous point, rows_max]."""
    rows_max: int
    plan: Plan
    seconds: float          # the winner's best time at rows_max rows
    mkl_seconds: float      # MKL's, for the report
    default_seconds: float  # the untuned default's (build tile, default blocking)
    speedup: float = 1.0    # default / winner, median of same-round ratios


@dataclass(slots=True)
class ShapeTuning:
    in_features: int
    out_features: int
    packed: bool
    points: list[PointChoice] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.out_features}x{self.in_features}{'p' if self.packed else ''}"

    def choice(self, rows: int) -> PointChoice | None:
        """The choice serving ``rows``, None past the last point (MKL beyond)."""
        i = bisect.bisect_left([p.rows_max for p in self.points], rows)
        return self.points[i] if i < len(self.points) else None


# ---- what is tuned here ------------------------------------------------------------------------

def _machine_key(threads: int) -> dict:
    """What a cached choice depends on: CPU model, kernel build (ISA + sources), torch, threads."""
    isa = selected_isa()
    return {"version": CACHE_VERSION, "cpu": cpu_model_name(), "isa": isa,
            "build": _build_dir(isa).name, "torch": torch.__version__, "threads": threads}


def cache_file(kind: str, key: dict) -> Path:
    """Where a per-machine choice of ``kind`` keyed by ``key`` is cached."""
    from kvforge.loader.catalog import cache_root
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_root()) / "tune" / f"{kind}-{digest}.json"


def cache_path(threads: int | None = None) -> Path:
    return cache_file("linear", _machine_key(threads or torch.get_num_threads()))


def row_points(max_rows: int, few_rows_max: int) -> list[int]:
    """1 .. few_rows_max (one register tile of all rows each), then powers of two up to
    max_rows (capped at MAX_TUNED_ROWS)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    top = min(max_rows, MAX_TUNED_ROWS)
    points = list(range(1, min(few_rows_max, top) + 1))
    p = 8
    while p < top:
        if p > points[-1]:
            points.append(p)
        p *= 2
    if top > points[-1]:
        points.append(top)
    return points


def tile_candidates(ops, rows: int, packed: bool) -> list[tuple[int, int]]:
    """Register tiles to try at ``rows``: the build's default first, then those whose
    accumulators (m * n) + x vectors (m) + one W vector fit the register file (one over: gcc may
    fold a load into an FMA), with enough accumulators to hide FMA latency, fewest loads per FMA
    ((m + n) / (m * n)) first. Few rows: m = rows, every width that fits."""
    regs = int(ops.linear_registers)
    default = tuple(ops.linear_plan(64, 64, rows, packed)[:2])
    if packed:
        # panels: the widest outer-product tile (4 rows AVX2, 8 AVX-512) has the fewest loads
        # per FMA, and fewer rows only serve a remainder (AVX2 timed: 2 or 3 rows a tile, 6%
        # slower at 64 rows)
        found = []
    elif rows <= int(ops.linear_few_rows_max):
        found = [(rows, n) for n in range(2, 9) if rows * n + rows + 1 <= regs + 1]
    else:
        fits = [(m, n) for m in range(2, 9) for n in range(2, 9)
                if m * n + m + 1 <= regs + 1 and m * n >= regs // 2]
        fits.sort(key=lambda t: ((t[0] + t[1]) / (t[0] * t[1]), -t[0] * t[1]))
        found = fits[:4]
    out = [default] + [t for t in found if t != default]
    return out[:4]


def _close(y: torch.Tensor, reference: torch.Tensor) -> bool:
    scale = reference.abs().max().item() + 1e-6
    return bool(torch.allclose(y, reference, rtol=1e-4, atol=1e-4 * scale))


def _time(fns: dict[Plan, Callable[[], torch.Tensor]], reference: torch.Tensor,
          label: str) -> dict[Plan, list[float]]:
    """Per-round times of every candidate whose first (untimed) result matches ``reference``.
    The calls go round-robin, as many rounds as fit STAGE_BUDGET_S (3 to 15), so a round's
    calls share the machine's state of the moment."""
    ok = {}
    t0 = time.perf_counter()
    for plan, fn in fns.items():
        if _close(fn(), reference):
            ok[plan] = fn
        else:
            logger.warning("linear plan %s gives wrong results at %s; not used", plan.label(),
                           label)
    one_round = time.perf_counter() - t0        # the checks: a round (with first-call costs)
    rounds = max(3, min(15, int(STAGE_BUDGET_S / max(one_round, 1e-9))))
    times: dict[Plan, list[float]] = {p: [] for p in ok}
    for _ in range(rounds):
        for p, fn in ok.items():
            t0 = time.perf_counter()
            fn()
            times[p].append(time.perf_counter() - t0)
    return times


def _ratios(times: dict[Plan, list[float]], base: Plan) -> dict[Plan, float]:
    """Each candidate's median over rounds of its time / ``base``'s time in the same round: a
    shared machine preempts a call now and then for a whole time slice, which spoils that
    round's ratio, not the median (a best-of-N time is spoilt when most calls are hit)."""
    out = {}
    for p, ts in times.items():
        r = sorted(t / b for t, b in zip(ts, times[base]))
        out[p] = r[len(r) // 2] if len(r) % 2 else (r[len(r) // 2 - 1] + r[len(r) // 2]) / 2
    return out


def tune_point(ops, rows: int, weights: _Rotation, packed_out: int,
               dense: torch.Tensor) -> PointChoice:
    """The fastest correct plan for ``rows`` rows over ``weight`` (staged search, module doc).
    A packed weight keeps the tiled kernel (MKL would need it unpacked at every call)."""
    in_features = dense.shape[1]
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    reference = F.linear(x, dense)
    packed = packed_out >= 0
    label = f"{rows} x {in_features} @ {dense.shape[0]} x {in_features}^T"

    def stage(plans):       # every copy holds the same values: any one checks against reference
        times = _time({p: (lambda p=p: p.run(ops, x, weights.next(), packed_out))
                       for p in dict.fromkeys([default] + plans)}, reference, label)
        if default not in times:
            raise RuntimeError(f"the default linear kernel gives wrong results at {label}")
        best_time.update({p: min(ts) for p, ts in times.items()})
        ratio.update(_ratios(times, default))

    mkl = Plan("mkl")
    tiles = [Plan("tiled", m, n) for m, n in tile_candidates(ops, rows, packed)]
    default = tiles[0]
    ratio: dict[Plan, float] = {}          # time / the default's, median of same-round pairs
    best_time: dict[Plan, float] = {}
    stage(tiles + ([] if packed else [mkl]))
    best = min((p for p in ratio if p.kind == "tiled"), key=ratio.get)
    if not packed and rows >= BLOCKING_ROWS_MIN:
        variants = []
        block_m = int(ops.linear_blocked_rows(rows, in_features, best.tile_m, best.tile_n))
        if block_m < rows:
            variants.append(Plan("tiled", best.tile_m, best.tile_n, block_m=block_m))
        lanes = int(ops.linear_lanes)
        block_k = max(lanes, int(ops.cache_sizes()[0]) // 2 // (4 * best.tile_n) // lanes * lanes)
        if block_k < in_features:
            variants.append(Plan("tiled", best.tile_m, best.tile_n, block_k=block_k))
        if variants:
            stage(variants + [best])
            best = min([best] + [v for v in variants if v in ratio], key=ratio.get)
    if not packed and rows <= PREFETCH_ROWS_MAX:
        prefetch = [Plan("tiled", best.tile_m, best.tile_n, best.block_k, best.block_m, d)
                    for d in (0, 4)]
        stage(prefetch + [best])
        best = min([best] + [p for p in prefetch if p in ratio], key=ratio.get)
    if ratio[best] > 1 - WIN_MARGIN:
        best = default
    winner = mkl if ratio.get(mkl, float("inf")) < ratio[best] * (1 - WIN_MARGIN) else best
    return PointChoice(rows, winner, best_time[winner], best_time.get(mkl, float("nan")),
                       best_time[default], 1.0 / ratio[winner])


def cache_sizes() -> dict[str, int]:
    """{'L1d': bytes, 'L2': ..., 'L3': ...} of cpu0 from sysfs (what Linux reports; the
    kernels block for sysconf's L1d / L2, the same numbers where both are known)."""
    out = {}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in sorted(root.glob("index*")):
            kind = (index / "type").read_text().strip()
            if kind == "Instruction":
                continue
            size = (index / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            out[f"L{(index / 'level').read_text().strip()}{'d' if kind == 'Data' else ''}"] = (
                int(size.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    return out


def machine_line() -> str:
    """'avx2 kernels, 2 threads, 16 vector registers, caches L1d 32 KiB L2 512 KiB L3 16 MiB'."""
    ops = cpu_kernels() if kernels_enabled() else None
    if ops is None:
        return "no compiled kernels (PyTorch ops)"
    sizes = " ".join(f"{k} {v >> 20} MiB" if v >= 1 << 20 else f"{k} {v >> 10} KiB"
                     for k, v in cache_sizes().items())
    return (f"{selected_isa()} kernels, {torch.get_num_threads()} threads, "
            f"{int(ops.linear_registers)} vector registers, caches {sizes or 'unknown'}")


def _cold_pool_bytes() -> int:
    """Weight bytes the timing rotates through: a few times L3, so each call streams its weight
    from memory as a decode step does (a hot copy would flatter memory-bound few-row plans)."""
    return max(32 << 20, min(256 << 20, 4 * cache_sizes().get("L3", 16 << 20)))


class _Rotation:
    """Copies of one weight used in turn, one per call (round-robin over the candidates too)."""

    def __init__(self, weight: torch.Tensor) -> None:
        count = min(256, max(1, -(-_cold_pool_bytes() // (weight.numel() * 4))))
        self.copies = [weight] + [weight.clone() for _ in range(count - 1)]
        self.i = 0

    def next(self) -> torch.Tensor:
        self.i = (self.i + 1) % len(self.copies)
        return self.copies[self.i]


def tune_shape(ops, in_features: int, out_features: int, points: list[int], packed: bool,
               progress: Callable[[str], None] | None = None) -> ShapeTuning:
    g = torch.Generator().manual_seed(out_features * 7919 + in_features)
    timed_out = min(out_features, TIMED_OUT_MAX)
    dense = torch.randn(timed_out, in_features, generator=g) * 0.05
    weight = dense
    packed_out = -1
    if packed:
        from kvforge.kernels.ops import pack_linear_weight
        weight, packed_out = pack_linear_weight(dense), timed_out
    weights = _Rotation(weight)
    tuning = ShapeTuning(in_features, out_features, packed)
    for rows in points:
        if progress:
            progress(f"{tuning.key} rows {rows}")
        tuning.points.append(tune_point(ops, rows, weights, packed_out, dense))
    return tuning


# ---- the cache and the installed choice --------------------------------------------------------

_installed: dict[tuple[int, int], ShapeTuning] = {}


def installed() -> dict[tuple[int, int], ShapeTuning]:
    """(in, out) -> the tuning the kernels run with now."""
    return dict(_installed)


def tuned_kernel_rows(in_features: int, out_features: int, rows: int) -> bool | None:
    """Whether the tiled kernel (True) or MKL (False) runs this product, None when untuned.
    Called per projection: one dict lookup and a bisect."""
    tuning = _installed.get((in_features, out_features))
    if tuning is None:
        return None
    choice = tuning.choice(rows)
    return choice is not None and choice.plan.kind == "tiled"


def install(tunings: list[ShapeTuning]) -> None:
    """Run the kernels with these choices (replacing any before); [] restores the defaults."""
    ops = cpu_kernels()
    entries = []
    _installed.clear()
    for t in tunings:
        _installed[(t.in_features, t.out_features)] = t
        for c in t.points:
            p = c.plan
            entries.append([t.in_features, t.out_features, c.rows_max, p.tile_m, p.tile_n,
                            p.block_k, p.block_m, p.prefetch_tiles, int(p.kind == "mkl")])
        # past the last point: MKL, as for any untuned product past LINEAR_ROWS_MAX
        entries.append([t.in_features, t.out_features, 2 ** 62, 0, 0, 0, 0, -1, 1])
    if ops is not None:
        ops.set_linear_plans(entries)


def _to_json(t: ShapeTuning) -> dict:
    return {"in": t.in_features, "out": t.out_features, "packed": t.packed,
            "points": [{"rows_max": c.rows_max, "plan": asdict(c.plan), "seconds": c.seconds,
                        "mkl_seconds": c.mkl_seconds, "default_seconds": c.default_seconds,
                        "speedup": c.speedup}
                       for c in t.points]}


def _from_json(d: dict) -> ShapeTuning:
    return ShapeTuning(int(d["in"]), int(d["out"]), bool(d["packed"]),
                       [PointChoice(int(c["rows_max"]), Plan(**c["plan"]), float(c["seconds"]),
                                    float(c["mkl_seconds"]), float(c["default_seconds"]),
                                    float(c.get("speedup", 1.0)))
                        for c in d["points"]])


def load_cache(path: Path) -> dict[str, ShapeTuning]:
    try:
        data = json.loads(path.read_text())
        return {k: _from_json(v) for k, v in data["shapes"].items()}
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError) as exc:      # a damaged cache is tuned again
        logger.warning("ignoring unreadable tuning cache %s (%s)", path, exc)
        return {}


def save_cache(path: Path, shapes: dict[str, ShapeTuning]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"machine": _machine_key(torch.get_num_threads()),
                               "shapes": {k: _to_json(v) for k, v in shapes.items()}},
                              indent=1))
    tmp.replace(path)


def _stderr_progress(done: int, total: int, what: str) -> None:
    """One line on stderr, rewritten in place on a terminal (else its first and last state)."""
    text = f"kvforge: tuning fp32 kernels for this CPU ({done}/{total}) {what}"
    if sys.stderr.isatty():
        sys.stderr.write(f"\r{text:<72}" + ("\n" if done == total else ""))
    elif done in (0, total):
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


def tune_linear_shapes(shapes: list[tuple[int, int, bool, int]], force: bool = False,
                       progress: Callable[[int, int, str], None] | None = _stderr_progress,
                       measure: bool = True) -> list[ShapeTuning]:
    """Choices for every (in, out, packed, max_rows) shape: from the cache, tuned where missing
    or covering fewer rows (all of them with ``force``), saved, and installed. Without
    compiled kernels (or with KVFORGE_TUNE=0 and no ``force``) nothing is tuned and []
    returned. ``measure=False`` installs the cached choices only: a shape without one runs
    the build's defaults, nothing is timed or written (an engine under a memory budget: the
    timing's cold copies of each weight take up to 256 MiB)."""
    ops = cpu_kernels() if kernels_enabled() else None
    if ops is None or (not force and not tuning_enabled()):
        return []
    path = cache_path()
    cached = {} if force else load_cache(path)
    few = int(ops.linear_few_rows_max)
    wanted, missing = [], []
    for in_f, out_f, packed, max_rows in dict.fromkeys(shapes):
        t = ShapeTuning(in_f, out_f, packed)
        points = row_points(max_rows, few)
        hit = cached.get(t.key)
        if hit is not None and [c.rows_max for c in hit.points][:len(points)] == points:
            wanted.append(hit)
        elif measure:
            missing.append((t, points))
        elif hit is not None:        # fewer rows than asked: the rows past them run defaults
            wanted.append(hit)
    total = sum(len(points) for _, points in missing)
    done = 0
    start = time.perf_counter()
    for t, points in missing:
        def step(what):
            nonlocal done
            if progress:
                progress(done, total, what)
            done += 1
        tuned = tune_shape(ops, t.in_features, t.out_features, points, t.packed, step)
        cached[tuned.key] = tuned
        wanted.append(tuned)
    if missing:
        if progress:
            progress(total, total, f"done in {time.perf_counter() - start:.1f} s")
        save_cache(path, cached)
    install(wanted)
    return wanted


def model_linear_shapes(model: torch.nn.Module, max_rows: int, head_rows: int
                        ) -> list[tuple[int, int, bool, int]]:
    """(in, out, packed, rows to tune) of every fp32 CPU projection of ``model`` our kernels
    run: ``max_rows`` (a step's tokens), ``head_rows`` for the LM head (it sees one row per
    sequence)."""
    from kvforge.layers.linear import Linear, PackedLinearMethod, UnquantizedLinearMethod
    head = getattr(model, "lm_head", None)
    shapes = []
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        method = module.method
        rows = head_rows if module is head else max_rows
        # an offloaded model's streamed layers hold no weight between steps: not tuned
        weight = getattr(module, "weight", None)
        if type(method) is PackedLinearMethod:
            shapes.append((module.input_size, module.output_size, True, rows))
        elif (type(method) is UnquantizedLinearMethod and weight is not None
              and weight.dtype == torch.float32 and weight.device.type == "cpu"):
            shapes.append((module.input_size, module.output_size, False, rows))
    merged: dict[tuple[int, int, bool], int] = {}
    for in_f, out_f, packed, rows in shapes:     # a shape shared with the head: the most rows
        merged[(in_f, out_f, packed)] = max(rows, merged.get((in_f, out_f, packed), 0))
    return [(*k, v) for k, v in merged.items()]


def tune_model(model: torch.nn.Module, max_rows: int, head_rows: int,
               force: bool = False, measure: bool = True) -> list[ShapeTuning]:
    """Tune (or load the cached choice for) ``model``'s fp32 projections and install it
    (``measure=False``: cached choices only, as tune_linear_shapes)."""
    shapes = model_linear_shapes(model, max_rows, head_rows)
    if not shapes:
        return []
    tunings = tune_linear_shapes(shapes, force=force, measure=measure)
    if not measure and len(tunings) < len(shapes) and tuning_enabled():
        logger.info("%d fp32 projection shape(s) not timed on this machine yet (not timed "
                    "under a memory budget): they run the build's defaults; `kvforge tune` "
                    "times them", len(shapes) - len(tunings))
    for line in describe(tunings):
        logger.info("fp32 linear plan %s", line)
    return tunings


def describe(tunings: list[ShapeTuning]) -> list[str]:
    """One line per shape: the choice per row range, with the speed-up over the default."""
    lines = []
    for t in tunings:
        parts, lo = [], 1
        for c in t.points:
            rows = f"{lo}" if lo == c.rows_max else f"{lo}-{c.rows_max}"
            parts.append(f"{rows}: {c.plan.label()} ({c.speedup:.2f}x)")
            lo = c.rows_max + 1
        parts.append(f">{t.points[-1].rows_max}: MKL")
        lines.append(f"{t.key}: " + ", ".join(parts))
    return lines
