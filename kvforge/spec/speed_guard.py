"""SpeedGuard: speculation runs only at batch sizes where it is measured to beat decoding alone.

Why: whether a speculative step pays depends on what a verification row costs on this machine
at this batch size, what the proposer costs, and how much of it is accepted now. The
decoder's policy (row cap, cost model) predicts that from start-up timings, and on the 1.5B
GGUF at batch 4 every method it let run was slower than the target alone (0.67-0.94x): rows of
block kernels cost more under load than calibrated, acceptance drifts with the text. The
guard measures instead, on the engine's own steps, and vetoes speculation where decoding
alone was faster -- a user never pays for turning speculation on.

Per batch size b (requests decoding in the step), two arms, each the last ``window`` steps of
its kind:

    spec    steps in which some request verified proposed tokens
    plain   steps in which none did (multi-step decodes included: what the engine does
            without speculation)

an arm's cost is its steps' wall seconds / the tokens their decodes emitted. The plain arm's
warm-up counts decode positions (tokens / b), not steps: a multi-step call of 4 tokens is 4
of the ``min_steps`` it needs. Plain steps vary little, and each call held back from
speculation costs its tokens (on the 1.5B's code edits, where speculation runs at ~0.5 of a
plain token's time, a warm-up of 8 four-token calls was ~10% of a run). Plain steps are
measured as the engine runs them, multi-step: one-token plain steps would cost ~3% more a
token at batch 4 on the 1.5B and bias the comparison towards speculation. Only steps in
which every scheduled request is a decode count (a prefill chunk costs the same either way
and would swamp the difference), and not the step in which a draft model runs its prefill of
a new request's prompt (a once-per-request cost, not a per-step one); a draft model's
catch-up after plain steps is charged to the spec step that needs it, as it should be.

    warm-up   the arms alternate until spec has ``min_steps`` steps, plain as many positions
    exploit   the cheaper arm; switching needs a ``hysteresis`` margin (no flapping on noise)
    probe     every ``probe_every``-th step runs the other arm, so its cost follows the text

Why windows of many steps and single-step probes: what speculation gains comes in bursts
(a copied span accepts everything, new text little), so a few steps measure the text of the
moment, not the arm: probes spread over the run see every kind of stretch, and the window's
average is what the arm gives over them. Exploration is the price: 1 step in ``probe_every``
on the losing arm (~2% of the time lost where speculation runs at 0.76x, ~1.5% where it
would run at 1.25x), and the warm-up at each batch size the first time it occurs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Arm:
    seconds: deque
    tokens: deque

    @classmethod
    def empty(cls, window: int) -> "_Arm":
        return cls(deque(maxlen=window), deque(maxlen=window))

    @property
    def num_steps(self) -> int:
        return len(self.seconds)

    def num_positions(self, batch: int) -> float:
        """Decode positions measured: tokens per decoding request."""
        return sum(self.tokens) / batch

    @property
    def seconds_per_token(self) -> float:
        return sum(self.seconds) / max(1, sum(self.tokens))


@dataclass
class _BatchSize:
    spec: _Arm
    plain: _Arm
    speculate: bool = True           # the arm exploited now
    steps: int = 0                   # steps asked about at this batch size
    compared: bool = False           # both arms have been measured


@dataclass
class SpeedGuardStats:
    denied_steps: int = 0            # steps in which the guard held speculation back
    probe_steps: int = 0             # steps that ran the arm not exploited, to re-measure it


@dataclass
class SpeedGuard:
    min_steps: int = 8
    window: int = 32
    probe_every: int = 16
    hysteresis: float = 0.03
    stats: SpeedGuardStats = field(default_factory=SpeedGuardStats)
    _sizes: dict[int, _BatchSize] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.window:
            raise ValueError(f"min_steps must be in [1, window={self.window}], got "
                             f"{self.min_steps!r}")
        if self.probe_every < 2:
            raise ValueError(f"probe_every must be >= 2, got {self.probe_every!r}")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis!r}")

    def allow(self, batch: int) -> bool:
        """May the next step, with ``batch`` requests decoding, speculate?"""
        size = self._sizes.get(batch)
        if size is None:
            size = self._sizes[batch] = _BatchSize(_Arm.empty(self.window),
                                                   _Arm.empty(self.window))
        size.steps += 1
        spec_short, plain_short = self._short(size, batch)
        if spec_short or plain_short:
            # warm-up: alternate, then give the arm still short of steps its turn (a step
            # allowed to speculate may propose nothing and count as plain)
            allowed = spec_short if spec_short != plain_short else size.steps % 2 == 1
        elif size.steps % self.probe_every == 0:
            allowed = not size.speculate
            self.stats.probe_steps += 1
        else:
            allowed = size.speculate
        if not allowed:
            self.stats.denied_steps += 1
        return allowed

    def record(self, batch: int, speculated: bool, seconds: float, tokens: int) -> None:
        """One decode-only step: ``tokens`` emitted by its ``batch`` decodes in ``seconds``."""
        size = self._sizes.get(batch)
        if size is None or tokens <= 0 or seconds <= 0:
            return                       # a batch size nobody asked about: nothing to decide
        arm = size.spec if speculated else size.plain
        arm.seconds.append(seconds)
        arm.tokens.append(tokens)
        if any(self._short(size, batch)):
            return
        size.compared = True
        spec, plain = size.spec.seconds_per_token, size.plain.seconds_per_token
        margin = 1.0 - self.hysteresis
        if (spec > plain / margin) if size.speculate else (spec < plain * margin):
            size.speculate = not size.speculate

    def _short(self, size: _BatchSize, batch: int) -> tuple[bool, bool]:
        """(spec arm short of its warm-up steps, plain arm short of its decode positions)"""
        return (size.spec.num_steps < self.min_steps,
                size.plain.num_positions(batch) < self.min_steps)

    def speculating(self, batch: int) -> bool | None:
        """The arm exploited at this batch size (None: not measured yet)."""
        size = self._sizes.get(batch)
        return size.speculate if size is not None and size.compared else None
