"""``num_assistant_tokens="auto"``: the number of drafts per round, chosen from what this call measures.

A round with K drafts yields ``E(K) = 1 + sum_{i<=K} prod_{j<=i} q_j`` tokens on average, where ``q_j`` is
the chance that draft j is accepted given that drafts 1..j-1 were (counted per position over this call's
rounds, from a Beta(1, 1) prior). It costs ``c(K) = c0 * (1 + r K)``: the target verifies K + 1 rows, and
the drafts add MTP work. Each round's wall time (from one ``get_candidates`` to the next, the host sync
transformers does included) is recorded under its K. The slope ``r`` is a least-squares fit once two K
values have times, and ``PRIOR_SLOPE`` before that. Every round drafts the K that maximises ``E(K) / c(K)``,
and every ``EXPLORE_EVERY``-th round a neighbouring K, so the slope keeps being measured. On CUDA the graphed
round always drafts ``max_k`` (one graph) and hands the verifier the first K.

Drafting can lose: a round costs the drafter's work on top of the target's step. When the best K is
expected to yield fewer than ``DOUBT`` tokens a round, the call measures plain steps (K = 0: the target
alone, its rows kept for the drafter's next round), compares the best ``E(K) / t(K)`` with ``1 / t(0)``
and drafts nothing while plain steps pay more. It then probes
(drafts the best K once) after ``PROBE_FIRST`` plain rounds, doubling the wait after every probe that still
says "plain" (at most ``PROBE_MAX``), so a call whose drafts all miss runs close to plain ``generate``.
A probe starts the acceptance counts afresh, so a call whose acceptance comes back returns to drafting.

Sampled calls do not time their rounds: a choice driven by timing noise would change the rounds, and with them
the random draws, so a seeded call would not repeat.  Their rounds cost what :func:`modeled_cost` says (a plain
step 1, a drafting round ``1 + PRIOR_DRAFT + PRIOR_SLOPE K``): every choice then follows from the call's
acceptance alone.  Greedy calls time their rounds (their output is the same whatever K is chosen).
DSpark's ``"auto"`` (:class:`ConfidenceLength`) weighs plain steps the same way before each block, with the
tokens its drafting rounds measurably yielded in place of ``E(K)``: its confidences come only after the block
is drafted, when the drafting is already paid for.
"""

from __future__ import annotations

import numbers
import statistics
import time

# Per extra draft, the round's cost relative to a plain step, before any is measured.
# BENCHMARKS.md: a 4-row verify costs ~1.1-1.2x a 1-row step on a 5-layer V4-Flash-shaped target.
PRIOR_SLOPE = 0.07
# A drafting round's drafter work relative to a plain step, for sampled calls (untimed): between the 12- and the
# 43-layer targets' measurements in BENCHMARKS.md.
PRIOR_DRAFT = 0.3
EXPLORE_EVERY = 8
# The MTP's drafts per round with "auto" (its graphed round drafts them all, the verifier gets a prefix): the
# published K.  A 4th draft cost ~7% of a round for none accepted at the published acceptance (BENCHMARKS.md, run K).
AUTO_MAX_DRAFTS = 3
# Rounds before plain steps are considered: the first (untimed: the drafter's pass over the prompt) and two
# timed ones.  Every drafting round that misses costs a plain step's worth or more (BENCHMARKS.md, run J).
PLAIN_FIRST = 3
DOUBT = 2.0  # expected tokens per round below which plain steps are measured and weighed against drafting
PROBE_FIRST, PROBE_MAX = 16, 256  # plain rounds before a probe, and the most the doubling waits


def modeled_cost(k: int) -> float:
    """A round's cost relative to a plain step, for untimed (sampled) calls: ``k`` verified drafts, 0 a plain step."""
    return 1.0 + (PRIOR_DRAFT + PRIOR_SLOPE * k if k else 0.0)


class _RoundCost:
    """Each round's wall time (from one round's choice to the next) recorded under the number of drafts it
    verified, and the fitted relative cost ``r`` of one more verified draft.  ``timed=False``: each round's
    :func:`modeled_cost` instead of its wall time (sampled calls: the module docstring)."""

    def __init__(self, max_k: int, timed: bool = True):
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}.")
        self.max_k, self.timed = max_k, timed
        self.times: dict[int, list[float]] = {}  # K -> round wall times (s)
        self.choices: list[int] = []  # the K of every round
        self._pending = None  # (K, start time) of the round in flight
        self._clock = time.perf_counter
        self.plain_run, self.probe_wait = 0, PROBE_FIRST  # plain rounds since the last drafting one; the wait

    def _medians(self) -> dict[int, float]:
        """Median wall time of the recent drafting rounds (K >= 1) under each K."""
        return {k: statistics.median(v[-32:]) for k, v in self.times.items() if v and k > 0}

    def slope(self) -> float:
        """``r``: the relative cost of one more draft, fitted from the recorded round times."""
        means = self._medians()
        if len(means) < 2:
            return PRIOR_SLOPE
        ks, ts = list(means), list(means.values())
        mk, mt = statistics.fmean(ks), statistics.fmean(ts)
        b = sum((k - mk) * (t - mt) for k, t in zip(ks, ts)) / sum((k - mk) ** 2 for k in ks)
        c0 = mt - b * mk
        return max(b / c0, 0.0) if c0 > 0 else PRIOR_SLOPE

    def round_time(self, k: int, r: float) -> float | None:
        """The wall time of a round verifying ``k >= 1`` drafts: measured, or scaled by ``1 + r k`` from the
        nearest measured K; None before any drafting round is timed."""
        means = self._medians()
        if k in means:
            return means[k]
        if not means:
            return None
        near = min(means, key=lambda m: abs(m - k))
        return means[near] * (1 + r * k) / (1 + r * near)

    def _start(self, k: int) -> int:
        """The round about to run verifies ``k`` drafts; ends the timing of the previous round."""
        now = self._clock()
        if self._pending is not None:
            pk, start = self._pending
            self.times.setdefault(pk, []).append(now - start if self.timed else modeled_cost(pk))
        self.choices.append(k)
        self._pending = (k, now)
        return k

    def skip_timing(self) -> None:
        """The round in flight is not a typical one (the drafter's first pass over the prompt): do not time it."""
        self._pending = None

    def _drafting_pays(self, expected: float, drafted_time) -> bool:
        """Whether the round about to run should draft: a round expected to yield ``expected`` tokens in
        ``drafted_time()`` seconds (None: unmeasured; asked only once plain steps are), against the measured
        plain steps.  False: a plain step (counted here).  A probe
        (drafting again after a run of plain steps) calls :meth:`_forget` and doubles the next wait."""
        if expected >= DOUBT or len(self.choices) < PLAIN_FIRST:
            return self._drafting()
        plain = self.times.get(0, [])
        if len(plain) < 2:
            return self._plain()  # measure plain steps; the first may hold one-off work (a graph's capture)
        drafted = drafted_time()
        if drafted is None or expected / drafted > 1 / statistics.median(plain[1:][-32:]):
            return self._drafting()
        if self.plain_run < self.probe_wait:
            return self._plain()
        # A probe: the counts are forgotten (the text may have changed while no draft was looked at), so this
        # round's drafts alone say whether drafting pays again; a probe that lands none doubles the wait.
        self._forget()
        self.probe_wait = min(2 * self.probe_wait, PROBE_MAX)
        return self._drafting()

    def _drafting(self) -> bool:
        self.plain_run = 0
        return True

    def _plain(self) -> bool:
        self.plain_run += 1
        self._start(0)
        return False

    def _landed(self, accepted: int) -> None:
        if accepted:
            self.probe_wait = PROBE_FIRST

    def _forget(self) -> None:
        """Drop the acceptance counts (a probe)."""
        raise NotImplementedError


class ConfidenceLength(_RoundCost):
    """The verify length of a drafter with a confidence head (DSpark, design §7b).  ``c_j`` estimates that
    draft j is accepted given drafts 1..j-1 were, so ``a_j = c_1 ... c_j`` is the chance the verifier gets past
    draft j and ``tau_j = 1 + a_1 + ... + a_j`` the tokens a round verifying j drafts yields.  With a
    ``threshold``: the longest prefix whose confidences are all at least it.  Without (``"auto"``): the paper's
    Algorithm 1 for one request, with the round's cost ``1 + r j`` measured in this call (:class:`_RoundCost`):
    lengthen while ``tau_j / (1 + r j)`` grows, stop at the first j where it does not.  Both rules read only the
    confidences up to j, which depend on the drafts before j: the choice is non-anticipating, so speculative
    sampling stays exact (design §7b).  Before drafting, ``"auto"`` asks :meth:`draft_now` whether a block pays at
    all (the module docstring's plain steps)."""

    def __init__(self, max_k: int, threshold: float | None = None, timed: bool = True):
        super().__init__(max_k, timed)
        if threshold is not None and (not isinstance(threshold, numbers.Real) or isinstance(threshold, bool)
                                      or not 0.0 <= threshold <= 1.0):
            raise ValueError(f"`assistant_confidence_threshold` must be a number in [0, 1], got {threshold!r}.")
        self.threshold = threshold
        self.yields: list[int] = []  # tokens each drafting round gave (accepted drafts + the verifier's own)

    def draft_now(self) -> bool:
        """Called before each round: whether to draft a block (the round's timing starts here, before the
        block; :meth:`choose` then sets its length) or take a plain step.  ``"auto"`` weighs the two (module
        docstring); with a threshold the user's rule always drafts."""
        if self.threshold is None:
            recent = self.yields[-32:]
            expected = (sum(recent) + 2) / (len(recent) + 1)  # a prior of one round that yielded two tokens
            if not self._drafting_pays(expected, self._block_time):
                return False
        self._start(self.max_k)
        return True

    def _block_time(self) -> float | None:
        """A drafting round's wall time: every round drafts the whole block, whatever it verifies."""
        times = [t for k, ts in self.times.items() if k > 0 for t in ts[-32:]]
        return statistics.median(times) if times else None

    def choose(self, confidences: list[float]) -> int:
        """The number of drafts (1..max_k) to verify in the round :meth:`draft_now` opened, from its confidences."""
        confidences = confidences[: self.max_k]
        if self.threshold is not None:
            k = next((j for j, c in enumerate(confidences) if c < self.threshold), len(confidences))
            return self._verify(max(k, 1))
        r, k, tau, survive = self.slope(), 0, 1.0, 1.0
        best = tau
        for j, c in enumerate(confidences, start=1):
            survive *= c
            tau += survive
            if tau / (1 + r * j) <= best:
                break
            k, best = j, tau / (1 + r * j)
        return self._verify(max(k, 1))

    def _verify(self, k: int) -> int:
        """The round :meth:`draft_now` opened verifies ``k`` drafts: its time is recorded under ``k``."""
        self.choices[-1] = k
        if self._pending is not None:
            self._pending = (k, self._pending[1])
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        """The confidences carry the acceptance estimate for the verify length; the tokens the round gave
        decide whether drafting pays at all."""
        self.yields.append(accepted + 1)
        self._landed(accepted)

    def _forget(self) -> None:
        self.yields = []


class AutoDraftLength(_RoundCost):
    """``num_assistant_tokens="auto"`` for a drafter without confidences (the MTP): the module docstring."""

    def __init__(self, max_k: int, timed: bool = True):
        super().__init__(max_k, timed)
        self.offered = [0] * max_k  # rounds that reached draft j with drafts 1..j-1 accepted
        self.taken = [0] * max_k  # ... and accepted draft j

    def expected_tokens(self, k: int) -> float:
        total, p = 1.0, 1.0
        for j in range(k):
            p *= (self.taken[j] + 1) / (self.offered[j] + 2)
            total += p
        return total

    def best(self) -> int:
        r = self.slope()
        return max(range(1, self.max_k + 1), key=lambda k: self.expected_tokens(k) / (1 + r * k))

    def choose(self) -> int:
        """The K of the round about to be drafted (0: a plain step); ends the timing of the previous round."""
        k = self.best()
        after_plain = self.plain_run > 0
        if not self._drafting_pays(self.expected_tokens(k), lambda: self.round_time(k, self.slope())):
            return 0
        if not after_plain and len(self.choices) % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            k = k + 1 if k < self.max_k else k - 1  # a neighbour, to keep the slope measured
        return self._start(max(1, k))

    def _forget(self) -> None:
        self.offered, self.taken = [0] * self.max_k, [0] * self.max_k

    def observe(self, drafted: int, accepted: int) -> None:
        self._landed(accepted)
        for j in range(min(drafted, self.max_k)):
            self.offered[j] += 1
            if j < accepted:
                self.taken[j] += 1
            else:
                break
