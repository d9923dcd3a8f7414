"""Equation discovery: recover a sparse polynomial ODE ``dx/dt = f(x)`` from trajectories.

Recipe of :class:`EquationDiscovery.fit`:

1. **Starts.** (a) Train a :class:`~polynets.PolyNODE` (Mu-Layers, degree ``>= degree``) on
   the trajectories over short windows in standardised units and expand it exactly with
   :func:`symbolic.to_sympy`, back in the data's units: a dense polynomial field close to the
   data; if it fails, the dense integral-form least squares takes its place.
   (b) Weak-form supports (:mod:`symbolic.weak`): sequentially thresholded least squares over a
   grid of thresholds, and per equation the best support of every size (exhaustive where the
   count allows, a beam search beyond), its size chosen by cross-validation over blocks of test
   functions or stopped at a grid of residual levels; at two test-function widths, each support
   with its weak-form coefficients, tried sparsest first (cheap fits finish early, and a start
   that cannot beat a finished candidate is abandoned before its elimination rounds).
2. **Safe trajectory fits.** Every start is refined by trajectory matching (multiple shooting,
   :mod:`symbolic.shooting`). A start that blows up within the windows is retried on windows
   half as long (down to 5 samples), then lengthened again from the shorter fit. A dense fit
   that does not converge is not used (a stall is no basis for elimination).
3. **Backward elimination** from each refined start: drop every term whose share of its
   equation on the data is below ``threshold``; when none is, drop the least significant term of
   each equation whose z-score (coefficient / standard error from the Gauss-Newton covariance,
   with the residual variance estimated from the fit, so no noise level is needed; zero for
   terms the data cannot identify, e.g. under a conservation law) is below ``significance``;
   refit (from the weak-form fit of the smaller support if the warm start blows up); repeat
   until every term is large and significant, or a smaller model blows up.
4. **Local swaps** (:meth:`EquationDiscovery._stepwise`): from the candidate of lowest BIC,
   each equation's best support of every size under the Gauss-Newton model of the trajectory
   fit (one evaluation of the sensitivities to every library coefficient), penalised per term;
   a proposal that differs is refit and eliminated, and kept as a candidate. This finds true
   supports that elimination lost to correlated stand-in terms (several spurious terms together
   replacing a true one), where no single term is significant on its own. When no such proposal
   is found, pairs of swaps across all equations are scored in the same model
   (:func:`pair_swaps`, two stand-ins that only fit when replaced together) and the best few
   refit, kept on the same evidence.
5. **Selection** among the candidates: the Bayesian information criterion of the trajectory
   fit, ``N ln(RSS / N) + k ln N`` (the residual variance floored at the integration accuracy,
   so on exact data the sparsest exact model wins; ``k`` counts the terms and the fitted window
   starts, so a candidate that blows up on the configured windows and is left on shorter ones
   pays for its extra starts), all evaluated on the same windows where they integrate, ranks
   the distinct supports; the few best on the same windows are compared by held-out window error
   (:func:`held_out_error`: coefficients refit on every other window, the held-out windows
   predicted from their own fitted starts), which needs no noise level and does not lean on
   BIC's asymptotics when a small term is near the noise (``selection`` = ``"bic+cv"``; ``"bic"``
   and ``"cv"`` use one rule alone).
6. **Parsimony among equals** (:meth:`EquationDiscovery._simplify`): a term of the chosen model
   is swapped for a monomial of lower degree when the data cannot tell the two apart (BIC within
   ``PARSIMONY_BIC`` of the choice): under noise a higher-degree stand-in (``y*z`` for ``y`` where
   ``z`` varies little) otherwise wins or loses by the noise draw. When no single swap is
   accepted, pairs of swaps of lower total degree are tried the same way (a stand-in that gives
   way only with a companion term, as under a conservation law).
7. **Longer windows** (:meth:`EquationDiscovery._lengthen`): the chosen support is refit on
   windows ``polish`` times longer, again and again, while a likelihood-ratio test finds the
   longer windows fit as well (:func:`continuity_holds`). Where they do not, the model may hold
   a stand-in that fits each short window but drifts over longer ones (``x*z`` for ``x**3`` where
   ``z`` decays with the oscillation's amplitude): the local swaps of step 4 are searched on
   those windows, and a swap is kept when its BIC there beats the chosen support's by
   ``SWAP_EVIDENCE`` and beats the chosen support's on the last windows it held on (the window
   starts counted); the lengthening goes on from it.
8. A final refit at the full integration tolerance, then on windows ``polish`` times longer,
   again and again up to whole trajectories, while a likelihood-ratio test finds the longer
   windows fit as well (:func:`continuity_holds`): fewer fitted window starts, less variance
   under noise; a chaotic trajectory stops the doubling where it no longer fits. Each state's
   noise level is estimated from that fit's residuals; where the levels differ beyond chance
   (relative to each state's spread, by which every fit divides the residuals), the support is
   refit with each state's residuals divided by its own level instead
   (:meth:`EquationDiscovery._reweight`, feasible generalised least squares). On exact data
   (a residual at the integration tolerance) the tolerance is then tightened, ten times per
   step down to 1e-13, while the residual keeps falling (:meth:`EquationDiscovery._sharpen`):
   the coefficients become as accurate as the data, not as the integrator. Terms whose effect
   on the data is at round-off level (:func:`drop_roundoff`) are set to zero: constant states
   give the exact model ``dx/dt = 0``.

Starts are tried safely: a start that blows up is retried on shorter windows, and once one
candidate is finished, a start whose criterion cannot beat it even with one term per equation is
abandoned (:meth:`EquationDiscovery._hopeless`) instead of pruned or lengthened.

Finally the data are checked for exact linear relations among the library's monomials
(:func:`library_relations`: an SVD of the column-normalised library on the samples, each
relation held to round-off or to the noise the final fit estimates). Under one, e.g. a
conservation law ``E + C = 0.5``, models that differ by multiples of it fit equally well and the
model returned is one choice among them: an :class:`~symbolic.errors.IdentifiabilityWarning`
names the relations, which are kept in ``relations_``; the model is not changed.

No knowledge of the true support is used anywhere. On exact data the kept coefficients are the
least-squares trajectory fit, accurate to the integration tolerance; with noise it is a
maximum-likelihood fit of the states (Gaussian noise of a level per state), far less biased
than regression on finite-difference derivatives. A :class:`~symbolic.errors.FitError` is raised
only when no start can be integrated over even the shortest windows, with what to change.
"""

from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import sympy
import torch
from scipy.integrate import solve_ivp
from sklearn.base import BaseEstimator
from threadpoolctl import threadpool_limits

from polynets.errors import PolynetsError
from symbolic.errors import (ExpressionError, FitError, IdentifiabilityWarning, NotFittedError,
                             SymbolicDataError)
from symbolic.expand import default_variables, to_sympy
from symbolic.export import derivative_symbol, to_latex, to_python, to_string
from symbolic.field import (PolyField, as_symbols, as_trajectories, monomial_exponents,
                            monomial_values)
from symbolic.prune import lstsq_integral, snap_coefficients, term_scales
from symbolic.shooting import (BUDGET_FACTOR, EXACT_RMS, ShootingResult, fit_trajectories,
                               local_quadratic, make_windows, residual_scale, state_noise)
from symbolic.weak import sparse_supports, subset_path, support_lstsq, weak_lstsq

__all__ = ["EquationDiscovery"]

MIN_WINDOW = 5
"""Shortest multiple-shooting window (samples) a blowing-up start is retried on."""


MAX_SPARSE_START = 0.5
"""Weak-form supports with more than this fraction of the library are left to the dense start."""

START_EVALUATIONS = 100
WARM_EVALUATIONS = 30
"""Residual evaluations of a trajectory fit from a start, and of a warm-started refit after
dropping terms (one that does not converge in them is reported as such)."""

SELECTIONS = ("bic", "cv", "bic+cv")

CV_SHORTLIST = 4
"""Candidates (distinct supports, best by BIC first) that ``selection="bic+cv"`` compares by
held-out window error."""

STEPWISE_ROUNDS = 4
"""Most rounds of :meth:`EquationDiscovery._stepwise`."""

SWAP_MIN_RMS = 100 * EXACT_RMS
"""A candidate whose residual RMS (in units of each variable's std) is below this reproduces the
data to about the integration accuracy; then :meth:`EquationDiscovery._stepwise` does nothing
(on exact data a swap can only trade one exact representation for another, e.g. under a
conservation law, and the residuals that would rank them are integration error)."""

SWAP_EVIDENCE = 6.0
"""BIC decrease a local swap must achieve over the candidate it starts from to be kept: a Bayes
factor of about 20, "strong" evidence on Kass and Raftery's scale. Under a collinear library
(e.g. ``S + E + I + R = 1``) near-equivalent representations differ by less, by chance."""

PARSIMONY_BIC = 2.0
"""A support whose BIC is above the chosen one's by at most this is as well supported by the data
("not worth more than a bare mention" on Kass and Raftery's scale: a Bayes factor below e);
:meth:`EquationDiscovery._simplify` then prefers it when its monomials are of lower degree."""

SIMPLIFY_REFITS = 3
"""Most proposals :meth:`EquationDiscovery._simplify` refits per round (in the order of
:func:`lower_degree_swaps`); its rounds are at most ``STEPWISE_ROUNDS``."""

SWAP_EXTRA = 2
"""Supports up to this many terms larger than the current one are searched per equation by
:func:`local_swaps`."""

PAIR_LIMIT = 20_000
"""Most pairs of single swaps :func:`pair_swaps` evaluates (beyond, the pairs among the single
swaps the Gauss-Newton model ranks best)."""

PAIR_REFITS = 3
"""Most pair-swap proposals :meth:`EquationDiscovery._stepwise` refits per round."""

REWEIGHT_ROUNDS = 3
"""Most refits of :meth:`EquationDiscovery._reweight` with each state weighted by its estimated
noise level (one or two suffice: a weighted fit's residuals estimate the levels well)."""

SEARCH_RTOL_FACTOR = 1e-3
MAX_SEARCH_RTOL = 1e-6

FINEST_RTOL = 1e-13
"""Tightest relative tolerance :meth:`EquationDiscovery._sharpen` integrates at (DOP853 in
float64 holds it; SciPy refuses below ``100 * eps``)."""

SHARPEN_GAIN = 4.0
""":meth:`EquationDiscovery._sharpen` tightens the tolerance again only while each step lowers
the residual sum of squares by more than this factor (integration error, not the data, still
dominates it)."""

ROUNDOFF = 100 * float(np.finfo(np.float64).eps)
"""A fitted term is round-off, and set to zero (:func:`drop_roundoff`), when even at its largest
on the data, over the longest trajectory's whole time span, it cannot move its state by more
than this fraction of the state's largest magnitude. The data hold each state to one unit in the
last place (``eps`` relative), and a trajectory fit of states that no term moves (constant data)
returns coefficients whose effect is of that order (about ``eps``: the rounding of the
residuals). The tightest fit integrates at ``FINEST_RTOL`` = 1e-13, about 450 ``eps``, so any
term whose effect a fit can resolve lies above this bound and is kept. The bound is relative to
each state's own magnitude and to the record's span: states of order 1e-6, or slow dynamics
with small coefficients, keep their terms."""

NULL_RTOL = 1000 * float(np.finfo(np.float64).eps)
"""Relative floor of :func:`library_relations`: a combination of the (RMS-normalised) library
columns whose singular value is below this times the largest holds to round-off. The SVD gives
singular values to about ``eps`` times the largest (backward stability); each column is a
product of up to ``degree`` stored values, each rounded to ``eps``, and a relation sums up to
a few tens of columns, some larger than their RMS (a transient), so an exact relation evaluates
to tens of ``eps``; a linear conservation law integrated by a Runge-Kutta method (which conserves
it exactly) holds to about ``1e-16`` relative. Near-relations that are not exact sit many orders
of magnitude above (the conic closest to a Lotka-Volterra orbit at 1e-2). The floor matters
only where the fit's noise estimate is below round-off (states no term moves); otherwise the
noise test decides (``RELATION_SIGMAS``)."""

RELATION_SIGMAS = 3.0
"""A relation holds up to the noise when its sum of squares on the data is at most what the
estimated noise alone gives it, plus this many standard deviations of a sum of ``N`` squares
(``sqrt(2 / N)`` relative; the acceptance of :func:`continuity_holds`), and so do its sums over
blocks of consecutive samples (:func:`_relation_test`). An exact relation measured with noise
comes out at or below its noise (the SVD minimises it); one that only nearly holds passes only
while its systematic part is well within the noise (sample by sample below about 0.65 of it for
100 samples, 0.4 for 1000, less again over blocks): on Lotka-Volterra's orbit the best conic is
2.6 times the noise at 5 % noise, 1.6 times at 10 %."""

RELATION_BLOCKS = 8
"""Fewest blocks of consecutive samples :func:`library_relations` tests a relation's block sums
on (the coarsest scale: fewer would make the test's own spread, ``sqrt(2 / blocks)``, too wide
to tell anything)."""

RELATION_DIGITS = 4
"""Significant digits of the coefficients an :class:`~symbolic.errors.IdentifiabilityWarning`
shows."""


def held_out_error(exps: np.ndarray, res: ShootingResult, active: np.ndarray,
                   trajectories: list[tuple[np.ndarray, np.ndarray]], *, rtol: float,
                   atol: float, max_iter: int = WARM_EVALUATIONS,
                   budget: int | None = None, per_window: bool = False
                   ) -> float | tuple[float, np.ndarray]:
    """Two-fold cross-validation of a trajectory fit over its windows.

    The windows of ``res`` are dealt alternately into two folds (both span the whole record).
    For each fold the coefficients are refit on the other fold's windows (warm from ``res``),
    then only the held-out windows' initial states are fitted with those coefficients fixed;
    the held-out residual (in units of each variable's std) is summed over both folds. Returns
    the mean squared held-out residual, floored at ``EXACT_RMS**2`` (models exact to the
    integration accuracy tie); ``inf`` if a fit blows up (or needs more than ``budget``
    right-hand-side evaluations per integration). ``per_window``: also return each window's
    mean squared held-out residual (windows, ), ``inf`` throughout on a blow-up.
    """
    windows = make_windows(trajectories, res.window)
    each = np.full(len(windows), math.inf)

    def out(value: float) -> float | tuple[float, np.ndarray]:
        return (value, each) if per_window else value

    if len(windows) < 2:
        return out(math.inf)
    scale = np.concatenate([X for _, X in trajectories]).std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    x0 = np.asarray(res.x0)
    total, count = 0.0, 0
    for fold in (0, 1):
        train = [w for w in range(len(windows)) if w % 2 != fold]
        test = [w for w in range(len(windows)) if w % 2 == fold]
        try:
            fitted = fit_trajectories(exps, res.coef, active, [windows[w] for w in train],
                                      x0=x0[train], rtol=rtol, atol=atol, max_iter=max_iter,
                                      budget=budget)
            held = fit_trajectories(exps, fitted.coef, np.zeros_like(active),
                                    [windows[w] for w in test], x0=x0[test], rtol=rtol,
                                    atol=atol, max_iter=max_iter, fixed=True, budget=budget)
        except FitError:
            each[:] = math.inf
            return out(math.inf)
        for w, states in zip(test, held.states):
            Xw = windows[w][1]
            sq = float(np.sum(((states - Xw) / scale) ** 2))
            each[w] = max(sq / Xw.size, EXACT_RMS**2)
            total += sq
            count += Xw.size
    return out(max(total / max(count, 1), EXACT_RMS**2))


def clearly_lower(errors: np.ndarray, reference: np.ndarray) -> bool:
    """Whether per-window held-out errors are lower than ``reference``'s (same windows) by more
    than two standard errors of their mean paired difference, the windows taken as the
    independent units."""
    diff = np.asarray(errors, dtype=float) - np.asarray(reference, dtype=float)
    if diff.size < 2 or not np.all(np.isfinite(diff)):
        return False
    return float(diff.mean()) < -2.0 * float(diff.std(ddof=1)) / math.sqrt(diff.size)


def residual_rms(res: ShootingResult) -> float:
    """Root mean square of a fit's (scaled) residuals."""
    return math.sqrt(res.rss / max(res.n_residuals, 1))


def at_tolerance(res: ShootingResult, rtol: float) -> bool:
    """Whether a fit reproduces the data to about the integration tolerance ``rtol`` (residual
    RMS within ``1 / SEARCH_RTOL_FACTOR`` of it): exact data, no noise to average out."""
    return residual_rms(res) <= rtol / SEARCH_RTOL_FACTOR


def exact_fit(res: ShootingResult) -> bool:
    """Whether a fit reproduces the data to about the integration accuracy of a search
    (``SWAP_MIN_RMS``): residuals that would rank its rivals are integration error."""
    return residual_rms(res) <= SWAP_MIN_RMS


def continuity_holds(longer: ShootingResult, shorter: ShootingResult, rtol: float) -> bool:
    """Whether a fit on longer windows explains the data as well as ``shorter`` does, by a
    likelihood-ratio test: the longer windows are the shorter ones joined (fewer free window
    starts), so under Gaussian noise ``N ln(RSS_long / RSS_short)`` is about chi-square with as
    many degrees of freedom as starts were removed; accepted up to three standard deviations
    above its mean. When ``shorter`` already reproduces the data to integration accuracy
    (residual RMS within ``1 / SEARCH_RTOL_FACTOR`` of ``rtol``: exact data, no noise to average
    out) the longer fit must do no worse per sample."""
    n = max(longer.n_residuals, 1)
    if at_tolerance(shorter, rtol):
        return longer.rss / n <= shorter.rss / max(shorter.n_residuals, 1)
    if not shorter.rss > 0:
        return False
    extra = max(shorter.n_params - longer.n_params, 1)
    statistic = n * math.log(max(longer.rss, 1e-300) / shorter.rss)
    return statistic <= extra + 3.0 * math.sqrt(2.0 * extra)


def no_worse_longer(longer: ShootingResult, shorter: ShootingResult, rtol: float) -> bool:
    """Whether a fit of one support on longer windows is the better estimate by the criterion
    candidates are chosen by (:func:`fit_criterion`, every fitted window start counted), on
    noisy data (residual RMS above ``rtol / SEARCH_RTOL_FACTOR``).

    The likelihood-ratio test of :func:`continuity_holds` assumes the fit is linear in its
    parameters near the optimum. Over long windows of a chaotic trajectory it is not (the
    states' sensitivities grow exponentially), and the statistic exceeds its chi-square bound
    for a correct support: on hyperchaotic Rossler at 1% noise, joining 200-sample windows into
    400-sample ones raised the RSS by 1.3% (statistic 24.9 against a bound of 12.5) while the
    coefficients' largest error fell from 0.43% to 0.09%, the maximum-likelihood fit's over the
    whole trajectory. Once the support is chosen, the window length only decides how the same
    terms are estimated, so the lower criterion may decide it (its penalty for the removed
    starts, ``ln N`` each, is what the RSS must not rise beyond)."""
    return not at_tolerance(shorter, rtol) and fit_criterion(longer) <= fit_criterion(shorter)


@contextmanager
def _timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    """Record in ``timings[stage]`` the seconds the ``with`` block takes."""
    began = time.perf_counter()
    yield
    timings[stage] = time.perf_counter() - began


def information_criterion(res: ShootingResult, terms: int) -> float:
    """BIC of a trajectory fit: ``N ln(max(RSS / N, EXACT_RMS^2)) + terms ln N``."""
    n = max(res.n_residuals, 1)
    return n * math.log(max(res.rss / n, EXACT_RMS**2)) + terms * math.log(n)


def fit_criterion(res: ShootingResult) -> float:
    """:func:`information_criterion` of a fitted candidate, every free parameter counted: its
    terms and its fitted window starts (on shorter windows more starts absorb noise)."""
    return information_criterion(res, res.n_params)


def unequal_noise(noise: np.ndarray, scale: np.ndarray, samples: int) -> bool:
    """Whether per-state noise estimates ``noise`` (dim,) differ beyond chance in units of the
    residual scale ``scale`` (dim,) a fit used, each from ``samples`` residuals: a
    likelihood-ratio test of one common Gaussian variance against one per state,
    ``samples * (dim ln(mean v) - sum ln v)`` with ``v = (noise / scale)**2``, about chi-square
    with ``dim - 1`` degrees of freedom when the levels are equal; accepted, as in
    :func:`continuity_holds`, up to three standard deviations above its mean. Equal levels mean
    the fit already weighted each state by its noise and is the maximum-likelihood one."""
    v = (np.asarray(noise, dtype=float) / np.asarray(scale, dtype=float)) ** 2
    extra = v.size - 1
    if extra < 1 or not np.all(np.isfinite(v) & (v > 0)):
        return False
    statistic = samples * (v.size * math.log(float(v.mean())) - float(np.log(v).sum()))
    return statistic > extra + 3.0 * math.sqrt(2.0 * extra)


def noise_scale(noise: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Per-state residual scale proportional to the noise levels ``noise`` (dim,), normalised so
    that its ratios to the states' spreads ``spread`` (dim,) have a geometric mean of one: the
    weights of the maximum-likelihood fit, while the residual stays about as large as in units
    of the spreads (the thresholds on exact data keep their meaning). A level below
    ``EXACT_RMS`` of its spread is floored there."""
    ratio = np.maximum(np.asarray(noise, dtype=float) / spread, EXACT_RMS)
    return spread * ratio / math.exp(float(np.mean(np.log(ratio))))


def drop_roundoff(coef: np.ndarray, exps: np.ndarray,
                  trajectories: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """``coef`` (p, dim) over the monomials ``exps`` with the round-off terms set to zero: those
    whose largest contribution on the data, times the longest trajectory's time span, is at most
    ``ROUNDOFF`` times the largest magnitude of their state (the term cannot change the state
    over the record by more than its rounding; data no term moves, e.g. constant states, are fit
    by coefficients of that size, which are round-off, not a model). Scale-aware: the criterion
    is relative to each state's magnitude and to the record's time span, so small states and
    slow dynamics keep their terms. A term that vanishes on every sample is dropped too (it
    contributes nothing to the fit)."""
    stacked = np.concatenate([X for _, X in trajectories])
    with np.errstate(over="ignore", invalid="ignore"):      # an overflowing term is kept
        reach = np.abs(monomial_values(stacked, exps)).max(axis=0)
    span = max(float(t[-1] - t[0]) for t, _ in trajectories)
    size = np.abs(stacked).max(axis=0)
    moves = np.abs(coef) * reach[:, None] * span
    return np.where(moves <= ROUNDOFF * size[None, :], 0.0, coef)


def _relation_test(theta: np.ndarray, dtheta: list[np.ndarray], sigma: np.ndarray,
                   floor: float, lengths: Sequence[int], white: bool
                   ) -> Callable[[np.ndarray], bool]:
    """``holds(c)``: whether ``theta @ c`` (a relation with raw coefficients ``c`` (p,)) vanishes
    on the samples up to round-off or noise.

    ``theta`` (N, p) the library on the samples (trajectories of ``lengths`` samples one after
    the other, each in time order), ``dtheta[j]`` (N, p) its derivatives in state ``j``,
    ``sigma`` (dim,) each state's noise standard deviation; ``floor`` the round-off RMS of a
    relation of unit norm in units of the columns' RMS. The noise a relation ``g`` picks up is
    propagated to first order, variance ``sum_j (dg/dx_j)^2 sigma_j^2`` per sample; the sum of
    squares of ``g`` must be at most the sum of those variances plus ``RELATION_SIGMAS``
    standard deviations (``sqrt(2 / N)`` relative), or at most the round-off floor.

    With ``white`` (measurement noise, independent from sample to sample) the same holds for
    the sums of ``g`` over blocks of 2, 4, 8, ... consecutive samples of a trajectory (while there
    are at least ``RELATION_BLOCKS`` blocks): an exact relation's residual is the noise, whose
    block sums grow like the square root of the block's length, while the systematic part of a
    relation that only nearly holds (the curve one trajectory traces, which a conic follows to
    within the noise sample by sample) adds up coherently and shows. Without ``white`` (exact
    data: what remains is integration error, smooth in time) only single samples are tested."""
    norm = np.sqrt(np.mean(theta**2, axis=0))
    norm = np.where(norm > 0, norm, 1.0)
    position = np.concatenate([np.arange(m) for m in lengths])
    trajectory = np.repeat(np.arange(len(lengths)), lengths)
    scales = []
    k = 1
    while True:
        blocks = np.unique(np.stack([trajectory, position // k]), axis=1, return_inverse=True)[1]
        blocks = np.asarray(blocks).reshape(-1)
        count = np.bincount(blocks).astype(np.float64)
        if k > 1 and len(count) < RELATION_BLOCKS:
            break
        scales.append((blocks, count, 1.0 + RELATION_SIGMAS * math.sqrt(2.0 / len(count))))
        if not white or len(count) < 2 * RELATION_BLOCKS:
            break
        k *= 2

    def holds(c: np.ndarray) -> bool:
        g = theta @ c
        v = sum((d @ c) ** 2 * float(s) ** 2 for d, s in zip(dtheta, sigma))
        least = (floor * float(np.linalg.norm(c * norm))) ** 2
        for blocks, count, bound in scales:
            square = float(np.sum(np.bincount(blocks, weights=g) ** 2))
            noise = float(np.sum(np.bincount(blocks, weights=v)))
            if square > max(least * float(np.sum(count**2)), bound * noise):
                return False
        return True

    return holds


def _tls(A: np.ndarray, cols: np.ndarray, pivot: int, norm: np.ndarray) -> np.ndarray | None:
    """The relation on the columns ``cols`` of the normalised library ``A`` (N, p) that holds
    best (total least squares: the smallest right singular vector), in raw coefficients (p,) with
    the ``pivot`` column's coefficient 1; None where it leaves the pivot out."""
    v = np.linalg.svd(A[:, cols], full_matrices=True)[2][-1]
    c = np.zeros(A.shape[1])
    c[cols] = v / norm[cols]
    at = int(np.nonzero(cols == pivot)[0][0])
    if abs(v[at]) < 1e-8 * np.abs(v).max():
        return None
    return c / c[pivot]


def _echelon(rows: np.ndarray, order: Sequence[int]) -> tuple[np.ndarray, list[int]]:
    """Reduced row echelon form of relations ``rows`` (r, p) in normalised coordinates.

    Pivots are taken in the column order ``order``, each on the first column where a remaining
    row has an entry of at least a tenth of the largest remaining one (a term of the relation,
    not its noise), on the row of the largest; rows left (numerically) zero are combinations of
    the pivoted ones and dropped. Returns the pivot rows (entry 1 at their pivot, 0 at the other
    pivots) and their pivot columns."""
    R = np.array(rows, dtype=np.float64)
    R /= np.maximum(np.linalg.norm(R, axis=1, keepdims=True), 1e-300)
    pivots: list[int] = []
    for k in order:
        top = len(pivots)
        if top == len(R):
            break
        rest = np.abs(R[top:])
        if rest.max() < 1e-9:
            break
        r = top + int(np.argmax(rest[:, k]))
        if abs(R[r, k]) < 0.1 * rest.max():
            continue
        R[[top, r]] = R[[r, top]]
        R[top] /= R[top, k]
        for other in range(len(R)):
            if other != top:
                R[other] -= R[other, k] * R[top]
        pivots.append(int(k))
    return R[:len(pivots)], pivots


def library_relations(exps: np.ndarray, trajectories: list[tuple[np.ndarray, np.ndarray]],
                      noise: np.ndarray, *, white: bool = True, max_degree: int | None = None
                      ) -> list[tuple[np.ndarray, int, float]]:
    """Linear relations among the monomials ``exps`` (p, dim) that the data satisfy.

    The library is evaluated on every sample and its columns divided by their RMS; the right
    singular vectors of smallest singular values are relations while each holds up to round-off
    (``NULL_RTOL`` times the largest singular value) or up to the noise ``noise`` (dim,), each
    state's noise standard deviation in data units, propagated to it (:func:`_relation_test`;
    with ``white``, measurement noise, also summed over blocks of consecutive samples, so a
    relation that only nearly holds on a trajectory is not taken for one hidden by the noise).
    This is done on the monomials of degree ``<= d`` for ``d = 1, 2, ...``: the relations of
    degree ``d`` that the lower ones times monomials do not account for (``E + C = 0.5`` implies
    ``S*E + S*C = 0.5*S``) are the new generators, written in reduced echelon form
    (:func:`_echelon`, pivots on the monomials of highest degree first, in library order; each
    relation leaves out the pivots of the others and of the implied ones) and made sparse by
    dropping their smallest terms while a total least-squares refit of the rest still holds.

    ``max_degree``: relations among monomials of at most this degree only (noisy data:
    linear ones; a noisy trajectory lies within its noise of curves that polynomials of higher
    degree can follow, which no residual test tells from an invariant).

    Returns one ``(coefficients (p,), pivot, rms)`` per generator: ``coefficients @ phi(x) = 0``
    on the data with coefficient 1 at monomial ``pivot``, ``rms`` its root mean square on the
    samples (none where a monomial overflows on the data)."""
    stacked = np.concatenate([X for _, X in trajectories])
    n, dim = stacked.shape
    p = len(exps)
    with np.errstate(over="ignore", invalid="ignore"):
        theta = monomial_values(stacked, exps)
    if not np.all(np.isfinite(theta)):
        return []
    dtheta = [monomial_values(stacked, np.maximum(exps - (np.arange(dim) == j), 0)) * exps[:, j]
              for j in range(dim)]
    norm = np.sqrt(np.mean(theta**2, axis=0))
    norm = np.where(norm > 0, norm, 1.0)
    A = theta / norm
    sigma = np.asarray(noise, dtype=np.float64)
    lengths = [len(X) for _, X in trajectories]
    degrees = exps.sum(axis=1)
    index = {tuple(int(k) for k in e): r for r, e in enumerate(exps)}
    found: list[tuple[np.ndarray, int, float]] = []
    top = int(degrees.max()) if max_degree is None else min(int(degrees.max()), max_degree)
    for d in range(1, top + 1):
        cols = np.nonzero(degrees <= d)[0]
        s, vt = np.linalg.svd(A[:, cols], full_matrices=True)[1:]
        holds = _relation_test(theta, dtheta, sigma, NULL_RTOL * float(s[0]) / math.sqrt(n),
                               lengths, white)
        null = []
        for v in vt[::-1]:
            c = np.zeros(p)
            c[cols] = v / norm[cols]
            if not holds(c):
                break
            null.append(c * norm)
        if not null:
            continue
        # the relations the lower-degree generators imply (times monomials), in echelon form;
        # the new generators are the rest of the null space, written without their pivots
        order = sorted((int(k) for k in cols), key=lambda k: (-int(degrees[k]), k))
        implied = []
        for c, _, _ in found:
            low = int(degrees[np.nonzero(c)[0]].max())
            for m in exps[degrees <= d - low]:
                w = np.zeros(p)
                for k in np.nonzero(c)[0]:
                    w[index[tuple(int(v) for v in exps[k] + m)]] += c[k]
                implied.append(w * norm)
        known, fixed = _echelon(np.array(implied), order) if implied else (None, [])
        new = len(null) - len(fixed)
        if new <= 0:
            continue
        V = np.array(null).T
        if fixed:
            Q = np.linalg.qr(known.T)[0]
            V = V - Q @ (Q.T @ V)
            R = np.linalg.svd(V, full_matrices=False)[0][:, :new].T
            for row, k in zip(known, fixed):
                R -= np.outer(R[:, k], row)
        else:
            R = V.T
        R, pivots = _echelon(R, [k for k in order if k not in fixed])
        taken = set(fixed) | set(pivots)
        for row, pivot in zip(R, pivots):
            c = row / norm
            c = c / c[pivot]
            keep = [int(k) for k in cols if k == pivot or (k not in taken and c[k] != 0.0)]
            for k in sorted(keep, key=lambda k: abs(c[k]) * norm[k]):
                if k == pivot:
                    continue
                trial = _tls(A, np.array([j for j in keep if j != k]), pivot, norm)
                if trial is not None and holds(trial):
                    keep.remove(k)
                    c = trial
            found.append((c, pivot, float(np.sqrt(np.mean((theta @ c) ** 2)))))
    return found


def relations_message(found: list[tuple[np.ndarray, int, float]],
                      monomials: list[sympy.Expr], shown: int = 4) -> str:
    """The text of an :class:`~symbolic.errors.IdentifiabilityWarning` for the relations
    ``found`` by :func:`library_relations` over ``monomials``: each as ``lhs = constant`` with
    ``RELATION_DIGITS`` significant digits and its RMS on the data, at most ``shown`` of them."""
    def number(value: float) -> str:
        return f"{value:.{RELATION_DIGITS}g}"

    sides = []
    for c, pivot, _ in found:
        order = [pivot] + [int(k) for k in np.nonzero(c)[0]
                           if k != pivot and monomials[k] != 1]
        lhs = ""
        for k in order:
            value = float(c[k])
            size = number(abs(value))
            term = str(monomials[k]) if size == "1" else f"{size}*{monomials[k]}"
            lhs += (f"-{term}" if value < 0 else term) if not lhs else \
                (f" - {term}" if value < 0 else f" + {term}")
        constant = sum(-float(c[k]) for k in np.nonzero(c)[0] if monomials[k] == 1)
        sides.append((lhs, number(constant) if constant != 0.0 else "0"))
    listed = [f"{lhs} = {rhs} ({f'up to {rms:.1g}' if rms > 0 else 'exactly'})"
              for (lhs, rhs), (_, _, rms) in zip(sides, found)][:shown]
    if len(found) > shown:
        listed.append(f"{len(found) - shown} more (see relations_)")
    one = len(found) == 1
    which = "this relation" if one else "these relations"
    text = listed[0] if one else ", ".join(listed[:-1]) + " and " + listed[-1]
    values = " and ".join(lhs for lhs, _ in sides[:shown])
    return (f"the data satisfy {text}: models that differ by multiples of {which} (or of "
            f"{'its' if one else 'their'} products with monomials of the library) fit equally "
            f"well; the terms returned are one choice among them. Add trajectories with other "
            f"values of {values} to tell them apart.")


def equation_quadratic(S: np.ndarray, g: np.ndarray, c0: np.ndarray, active: np.ndarray,
                       i: int) -> tuple[np.ndarray, np.ndarray]:
    """Equation ``i``'s part of the Gauss-Newton model of a trajectory fit as a least-squares
    problem: with the other equations' active coefficients minimised out,
    ``RSS(c_i) = ||G c_i - beta||^2 + const`` over its ``p`` (scaled) library coefficients.
    ``S``, ``g`` from :func:`~symbolic.shooting.local_quadratic`, ``c0`` (p * dim,) the scaled
    coefficients it was taken at, ``active`` (p, dim). Returns ``G`` (r, p), ``beta`` (r,)."""
    p, dim = active.shape
    flat = active.reshape(-1)
    eq = np.arange(p) * dim + i
    others = np.nonzero(flat & (np.arange(flat.size) % dim != i))[0]
    Sii, gi = S[np.ix_(eq, eq)], g[eq]
    if len(others):
        Soi = S[np.ix_(others, eq)]
        proj = np.linalg.lstsq(S[np.ix_(others, others)],
                               np.hstack([Soi, g[others, None]]), rcond=1e-12)[0]
        Sii = Sii - Soi.T @ proj[:, :-1]
        gi = gi - Soi.T @ proj[:, -1]
    # RSS(c) = c^T Sii c - 2 b^T c + const = ||G c - beta||^2 + const
    b = Sii @ c0[eq] - gi
    vals, vecs = np.linalg.eigh(0.5 * (Sii + Sii.T))
    keep = vals > 1e-10 * max(float(vals.max()), 1e-300)
    G = np.sqrt(vals[keep])[:, None] * vecs[:, keep].T
    beta = (vecs[:, keep].T @ b) / np.sqrt(vals[keep])
    return G, beta


def model_rss(G: np.ndarray, beta: np.ndarray, cols: np.ndarray) -> float:
    """Residual of :func:`equation_quadratic`'s least squares on the columns ``cols``."""
    return float(np.sum((G @ support_lstsq(G, beta, cols) - beta) ** 2))


def local_swaps(S: np.ndarray, g: np.ndarray, norm: np.ndarray, coef: np.ndarray,
                active: np.ndarray, penalty: float, extra: int = SWAP_EXTRA
                ) -> tuple[np.ndarray, np.ndarray]:
    """Best support of every equation under the local Gauss-Newton model of a trajectory fit.

    ``S``, ``g``, ``norm`` from :func:`~symbolic.shooting.local_quadratic` at coefficients
    ``coef`` of support ``active`` (p, dim). For each equation the other equations' active
    coefficients are minimised out (:func:`equation_quadratic`) and its best support of every
    size up to ``extra`` more terms than now is found (:func:`~symbolic.weak.subset_path`); the
    size minimising ``RSS + penalty * terms`` (RSS of the quadratic model) is kept when that
    beats the current support. Returns the proposed support (p, dim) and its Gauss-Newton
    coefficients (the current ones where unchanged)."""
    p, dim = active.shape
    c0 = coef.reshape(-1) * norm
    proposal, new = active.copy(), coef.copy()
    for i in range(dim):
        G, beta = equation_quadratic(S, g, c0, active, i)
        current = np.nonzero(active[:, i])[0]
        best_cols, best = current, model_rss(G, beta, current) + penalty * len(current)
        for support, _ in subset_path(G, beta, max_terms=min(p, len(current) + extra)):
            cols = np.nonzero(support)[0]
            value = model_rss(G, beta, cols) + penalty * len(cols)
            if value < best - 1e-9 * abs(best):
                best_cols, best = cols, value
        if not np.array_equal(best_cols, current):
            proposal[:, i] = False
            proposal[best_cols, i] = True
            new[:, i] = support_lstsq(G, beta, best_cols) / norm[np.arange(p) * dim + i]
    return proposal, new


def lower_degree_swaps(S: np.ndarray, g: np.ndarray, norm: np.ndarray, coef: np.ndarray,
                       active: np.ndarray, degrees: np.ndarray, tolerance: float
                       ) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Supports one term simpler than ``active`` that fit about as well, under the local
    Gauss-Newton model of a trajectory fit (as :func:`local_swaps`).

    Every active term of every equation is replaced in turn by each inactive monomial of lower
    total degree (``degrees`` (p,)); a swap whose model RSS exceeds the current one by at most
    ``tolerance`` is returned as ``(RSS increase, support (p, dim), Gauss-Newton coefficients
    (p, dim))``, largest degree drop first, then smallest increase."""
    p, dim = active.shape
    c0 = coef.reshape(-1) * norm
    out: list[tuple[int, float, np.ndarray, np.ndarray]] = []
    for i in range(dim):
        G, beta = equation_quadratic(S, g, c0, active, i)
        current = np.nonzero(active[:, i])[0]
        base = model_rss(G, beta, current)
        for k in current:
            for j in np.nonzero(~active[:, i] & (degrees < degrees[k]))[0]:
                cols = np.sort(np.append(current[current != k], j))
                increase = model_rss(G, beta, cols) - base
                if increase <= tolerance:
                    support, new = active.copy(), coef.copy()
                    support[k, i], support[j, i] = False, True
                    new[:, i] = support_lstsq(G, beta, cols) / norm[np.arange(p) * dim + i]
                    out.append((int(degrees[j] - degrees[k]), increase, support, new))
    out.sort(key=lambda item: (item[0], item[1]))
    return [(increase, support, new) for _, increase, support, new in out]


def pair_swaps(S: np.ndarray, g: np.ndarray, norm: np.ndarray, coef: np.ndarray,
               active: np.ndarray, *, degrees: np.ndarray | None = None,
               tolerance: float = 0.0, limit: int = PAIR_LIMIT
               ) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Supports two terms away from ``active`` (two active terms out, two inactive ones in, each
    in the same equation as the term it replaces), all equations' coefficients refit together
    under the Gauss-Newton model of a trajectory fit.

    :func:`local_swaps` changes one equation at a time with the others' supports fixed, and
    :func:`lower_degree_swaps` one term at a time. When a combination of states is (nearly)
    conserved, or two equations share a stand-in, a wrong term is compensated by another, in its
    own equation or in another one: replacing either alone fits worse, both together as well or
    better, and only a joint move finds it. ``S``, ``g``, ``norm`` from
    :func:`~symbolic.shooting.local_quadratic` at coefficients ``coef`` of support ``active``
    (p, dim). Every single swap (an active term for an inactive monomial of its equation) is
    scored by the model, and every pair of them is evaluated, or, past ``limit`` pairs, the pairs
    among the single swaps that fit best.

    Without ``degrees``: the pairs predicted to lower the residual, largest decrease first.
    With ``degrees`` (p,) the monomials' total degrees: the pairs whose new terms are each of at
    most the degree of the term they replace and together of lower degree, predicted to raise
    the residual by at most ``tolerance``, largest degree drop first, then smallest increase.
    Returns ``(predicted RSS decrease, support (p, dim), Gauss-Newton coefficients (p, dim))``.
    """
    p, dim = active.shape
    flat = active.reshape(-1)
    c0 = coef.reshape(-1) * norm
    b = S @ c0 - g                    # RSS(c) = const + c^T S c - 2 b^T c, c scaled
    on = np.nonzero(flat)[0]
    if len(on) < 2:
        return []

    def gain(supports: np.ndarray) -> np.ndarray:
        """``b_A^T S_AA^+ b_A`` per support (rows of flat indices): the RSS is const minus it."""
        SA = S[supports[:, :, None], supports[:, None, :]]
        bA = b[supports]
        return np.einsum("na,na->n", bA, _batch_solve(SA, bA))

    base = float(gain(on[None])[0])
    eq, deg = np.arange(flat.size) % dim, None
    if degrees is not None:
        deg = np.repeat(np.asarray(degrees), dim)          # flat index k * dim + i
    singles = [(a, j) for a in range(len(on))
               for j in np.nonzero(~flat & (eq == eq[on[a]]))[0]
               if deg is None or deg[j] <= deg[on[a]]]
    if not singles:
        return []
    swapped = np.repeat(on[None], len(singles), axis=0)
    for n, (a, j) in enumerate(singles):
        swapped[n, a] = j
    order = np.argsort(-gain(swapped), kind="stable")
    keep = len(order)
    while keep * (keep - 1) // 2 > limit:
        keep -= 1
    chosen = [singles[n] for n in order[:keep]]
    pairs = [(u, v) for u in range(len(chosen)) for v in range(u + 1, len(chosen))
             if chosen[u][0] != chosen[v][0] and chosen[u][1] != chosen[v][1]]
    drop = np.zeros(len(pairs), dtype=np.int64)
    if deg is not None:
        drop = np.array([deg[on[chosen[u][0]]] + deg[on[chosen[v][0]]] - deg[chosen[u][1]]
                         - deg[chosen[v][1]] for u, v in pairs], dtype=np.int64)
        pairs = [pair for pair, d in zip(pairs, drop) if d > 0]
        drop = drop[drop > 0]
    if not pairs:
        return []
    supports = np.repeat(on[None], len(pairs), axis=0)
    for n, (u, v) in enumerate(pairs):
        supports[n, chosen[u][0]] = chosen[u][1]
        supports[n, chosen[v][0]] = chosen[v][1]
    gains = gain(supports) - base
    floor = 1e-9 * max(abs(base), 1e-300)
    ok = gains >= -tolerance if deg is not None else gains > floor
    out, seen = [], set()
    for n in np.lexsort((-gains, -drop)):
        cols = np.sort(supports[n])
        if not ok[n] or cols.tobytes() in seen:
            continue
        seen.add(cols.tobytes())
        support = np.zeros(flat.size, dtype=bool)
        support[cols] = True
        scaled = np.zeros(flat.size)
        scaled[cols] = np.linalg.lstsq(S[np.ix_(cols, cols)], b[cols], rcond=None)[0]
        out.append((float(gains[n]), support.reshape(p, dim), (scaled / norm).reshape(p, dim)))
    return out


def _batch_solve(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``A[n]^+ b[n]`` for a stack of small symmetric positive semi-definite systems (a
    singular one, e.g. under an exact conservation law, by its pseudo-inverse)."""
    try:
        return np.linalg.solve(A, b[..., None])[..., 0]
    except np.linalg.LinAlgError:
        return np.einsum("nij,nj->ni", np.linalg.pinv(A, hermitian=True), b)


class EquationDiscovery(BaseEstimator):
    """Sparse polynomial ODE discovery with a Poly-NODE, weak-form starts and trajectory refits.

    A scikit-learn estimator: the constructor only stores its arguments, ``fit(t, X)`` learns
    and returns self, fitted state ends with an underscore (``clone``, ``get_params``,
    ``set_params``, ``check_is_fitted`` work).

    Args:
        degree: maximal total degree of the monomial library (constant term included).
        variables: state names (default ``x, y, z`` / ``x1..xn``), the order of X's columns.
        threshold: terms whose RMS contribution is below ``threshold`` times the RMS of their
            equation on the data are dropped.
        significance: terms whose z-score stays below this are dropped (one per equation and
            round, least significant first).
        noise: optional noise level as a fraction of each variable's standard deviation; when
            given it floors the residual variance used for z-scores. Not needed: by default the
            variance is estimated from the fit.
        window: samples per multiple-shooting window of the trajectory refits (None: whole
            trajectories).
        polish: once the model is chosen, refit on windows ``polish`` times longer, and again,
            up to whole trajectories (more samples per fitted initial state: lower variance under
            noise); each longer fit is kept only if it converges and a likelihood-ratio test
            accepts its residual (:func:`continuity_holds`); where it does not, swaps are searched
            on the longer windows (:meth:`_lengthen`). ``1`` skips both.
        sparse_starts: also start from sequentially thresholded weak-form supports.
        hidden, node_steps, node_window, lr: Poly-NODE width, training steps, training window
            (samples) and learning rate.
        snap_tol: if set, coefficients within this relative distance of a number with at most
            six decimals are snapped to it at the end.
        rtol, atol: tolerances of the refit integrations (on data a model reproduces to about
            ``rtol``, the final fit tightens them while that lowers the residual).
        selection: ``"bic+cv"`` (default) the lowest held-out window error among the
            ``CV_SHORTLIST`` supports of lowest BIC; ``"bic"`` the lowest BIC; ``"cv"`` the
            lowest held-out window error over all candidates (slower).
        progress: show progress bars.
        seed: seed of the Poly-NODE initialisation and batches.

    Fitted attributes: ``coef_`` (p, dim) over the monomials ``library_`` (p, dim exponents),
    ``variables_`` the state symbols, ``model_`` the trained Poly-NODE, ``node_exprs_`` its
    exact expansion in the data's units, ``start_`` the start of the chosen model (``"node"``,
    ``"lstsq"`` the dense integral-form least squares, ``"weak"``, ``"stepwise"`` a local
    swap, see :meth:`_stepwise`, ``"simpler"`` a lower-degree swap, see :meth:`_simplify`, or
    ``"longer"`` a swap found on longer windows, see :meth:`_lengthen`),
    ``candidates_`` one record per start (terms, RSS, criterion, held-out error ``cv`` where
    computed, window, converged, or the error),
    ``rounds_`` the terms and residual per elimination round of the chosen model, ``result_`` its
    :class:`~symbolic.shooting.ShootingResult`, ``converged_`` whether its last fit converged,
    ``x0_`` the fitted window starts, ``fit_window_`` the final window length,
    ``state_noise_`` (dim,) each state's noise standard deviation estimated from the final
    fit's residuals (data units), ``residual_scale_`` (dim,) what each state's residuals were
    divided by in the final fit (its standard deviation, or its estimated noise level where the
    levels differ, see :meth:`_reweight`), ``relations_`` the linear relations among the
    library's monomials that the fit data satisfy up to round-off or noise, as sympy expressions
    equal to zero on them (e.g. ``E + C - 0.5`` under a conservation law; empty when there is
    none; where there is one, models that differ by multiples of it fit equally well, the model
    returned is one of them and an :class:`~symbolic.errors.IdentifiabilityWarning` says so, see
    :meth:`_identify`), ``timings_`` seconds spent per stage (``node``: the data's preparation
    and the Poly-NODE start, ``sparse_starts``, ``stepwise``, ``select``, ``simplify``,
    ``lengthen``, ``finish``: the final fit and identifiability check) and in all (``total``).
    """

    def __init__(self, degree: int = 2, *, variables: Sequence[str] | None = None,
                 threshold: float = 1e-3, significance: float = 4.0, noise: float | None = None,
                 window: int | None = 50, polish: int = 2, sparse_starts: bool = True,
                 hidden: int = 16, node_steps: int = 100, node_window: int = 6,
                 lr: float = 2e-2, snap_tol: float | None = None, rtol: float = 1e-10,
                 atol: float = 1e-12, selection: str = "bic+cv", progress: bool = True,
                 seed: int = 0) -> None:
        self.degree = degree
        self.variables = variables
        self.threshold = threshold
        self.significance = significance
        self.noise = noise
        self.window = window
        self.polish = polish
        self.sparse_starts = sparse_starts
        self.hidden = hidden
        self.node_steps = node_steps
        self.node_window = node_window
        self.lr = lr
        self.snap_tol = snap_tol
        self.rtol = rtol
        self.atol = atol
        self.selection = selection
        self.progress = progress
        self.seed = seed

    # ------------------------------------------------------------------------------------ fit
    def _validate(self) -> None:
        degree = self.degree
        if isinstance(degree, bool) or not isinstance(degree, (int, np.integer)) or degree < 1:
            raise ExpressionError(f"degree must be a positive int, got {degree!r}")
        for name in ("threshold", "significance"):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.number)) or not np.isfinite(value) \
                    or value < 0:
                raise ExpressionError(f"{name} must be a non-negative number, got {value!r}")
        if self.noise is not None and (not np.isfinite(self.noise) or self.noise < 0):
            raise ExpressionError(f"noise must be a non-negative fraction, got {self.noise!r}")
        if self.window is not None and (isinstance(self.window, bool) or int(self.window) < 3):
            raise ExpressionError(f"window must be None or an int >= 3, got {self.window!r}")
        if self.selection not in SELECTIONS:
            raise ExpressionError(f"selection must be one of {SELECTIONS}, got "
                                  f"{self.selection!r}")
        if isinstance(self.polish, bool) or int(self.polish) < 1:
            raise ExpressionError(f"polish must be an int >= 1, got {self.polish!r}")
        steps = self.node_steps
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
            raise ExpressionError(f"node_steps must be a non-negative int, got {steps!r}")
        snap = self.snap_tol
        if snap is not None and (isinstance(snap, bool) or
                                 not isinstance(snap, (int, float, np.number)) or
                                 not np.isfinite(snap) or snap < 0):
            raise ExpressionError(f"snap_tol must be None or a non-negative number, got "
                                  f"{snap!r}")

    def _train_node(self, trajectories: list[tuple[np.ndarray, np.ndarray]],
                    syms: list[sympy.Symbol]) -> np.ndarray:
        """Train a Poly-NODE in standardised units; its expansion in the data's units (p, d)."""
        from polynets.nn.node import PolyNODE, train_node

        stacked = np.concatenate([X for _, X in trajectories])
        mu, sd = stacked.mean(axis=0), stacked.std(axis=0)
        sd = np.where(sd > 0, sd, 1.0)
        rates = np.concatenate([np.diff((X - mu) / sd, axis=0) / np.diff(t)[:, None]
                                for t, X in trajectories])
        rate = float(np.sqrt(np.mean(rates**2))) or 1.0
        d = len(syms)
        torch.manual_seed(self.seed)
        model = PolyNODE(d, hidden=self.hidden, degree=self.degree, dtype=torch.float64)
        self.node_history_ = train_node(
            model, [(t - t[0]) * rate for t, _ in trajectories],
            [(X - mu) / sd for _, X in trajectories], steps=self.node_steps,
            window=self.node_window, lr=self.lr, seed=self.seed, progress=self.progress)
        self.model_ = model
        zs = [sympy.Symbol(f"_z{j}") for j in range(d)]
        exprs = to_sympy(model, variables=zs)
        back = {z: (s - float(m)) / float(v) for z, s, m, v in zip(zs, syms, mu, sd)}
        physical = [sympy.expand(e.xreplace(back) * float(sd[i]) * rate)
                    for i, e in enumerate(exprs)]
        self.node_exprs_ = physical
        full = PolyField.from_exprs(physical, syms)
        rows = {tuple(int(k) for k in r): i for i, r in enumerate(full.exps)}
        coef = np.zeros((len(self.library_), d))
        for k, e in enumerate(self.library_):
            if tuple(int(v) for v in e) in rows:
                coef[k] = full.coef[rows[tuple(int(v) for v in e)]]
        return coef

    def _refit(self, coef: np.ndarray, active: np.ndarray, x0: np.ndarray | None,
               window: int | None, *, exact: bool = False,
               max_iter: int = START_EVALUATIONS) -> ShootingResult:
        """Trajectory fit; while searching, the integration tolerance follows the residual
        level (``SEARCH_RTOL_FACTOR`` times the residual RMS, at most ``MAX_SEARCH_RTOL``), so
        noisy data is not integrated to 1e-10; ``exact`` uses ``rtol`` and ``atol``."""
        rtol = self.rtol if exact else self._search_rtol
        res = fit_trajectories(self.library_, coef, active, self.trajectories_, window=window,
                               x0=x0, rtol=rtol, atol=self.atol * rtol / self.rtol,
                               max_iter=max_iter, budget=None if exact else self._budget())
        if self._work is None and not exact:
            self._work = res.work
        rms = residual_rms(res)
        self._search_rtol = max(self._search_rtol,
                                min(MAX_SEARCH_RTOL, SEARCH_RTOL_FACTOR * rms))
        return res

    def _budget(self) -> int | None:
        """Right-hand-side evaluations a search fit may spend per integration: ``BUDGET_FACTOR``
        times what the first fitted model (the dense start, which reproduces the data) took on
        the data, so a pruned model that turns stiff is abandoned like a blow-up instead of
        integrated at any cost; None until a model was fitted."""
        return None if self._work is None else BUDGET_FACTOR * max(self._work, 500)

    def _fit_safely(self, coef: np.ndarray, active: np.ndarray,
                    candidates: Sequence[dict] = ()) -> ShootingResult:
        """Trajectory fit on the configured windows; a start that blows up is fitted on windows
        half as long (down to ``MIN_WINDOW`` samples), then refit on the configured windows
        from there when that works. Raises FitError when even the shortest windows blow up.

        Once another start has given a finished candidate, a retry on shorter windows gets
        ``WARM_EVALUATIONS`` residual evaluations, and a start whose short-window fit already
        cannot beat that candidate (:meth:`_hopeless`) is abandoned instead of lengthened."""
        window = self.window
        finished = any("result" in c for c in candidates)
        while True:
            try:
                res = self._refit(coef, active, None, window,
                                  max_iter=WARM_EVALUATIONS if finished and window != self.window
                                  else START_EVALUATIONS)
                break
            except FitError:
                longest = max(len(t) for t, _ in self.trajectories_) if window is None \
                    else int(window)
                if longest <= MIN_WINDOW:
                    raise
                window = max(MIN_WINDOW, longest // 2)
        if window != self.window and self._hopeless(res, candidates):
            raise FitError(f"the start blows up on the configured windows and its fit on windows "
                           f"of {window} samples cannot beat a finished candidate")
        while window != self.window:
            window = self.window if window is None or self.window is None \
                else min(int(self.window), 2 * int(window))
            try:
                longer = self._refit(res.coef, active, None, window)
            except FitError:
                break
            res = longer
        return res

    def _eliminate(self, res: ShootingResult, active: np.ndarray,
                   noise: float | None) -> tuple[ShootingResult, np.ndarray, list[dict]]:
        """Backward elimination by share and z-score from a fitted dense or sparse start."""
        active = active.copy()
        stacked = np.concatenate([Xi for _, Xi in self.trajectories_])
        field = PolyField(self.variables_, self.library_, res.coef)
        rounds = [{"terms": int(active.sum()), "rss": res.rss}]
        dim = active.shape[1]
        while True:
            field.coef = res.coef
            scales = term_scales(field, stacked)
            z = np.abs(np.nan_to_num(res.zscore, nan=0.0))
            if noise is not None and noise > 0:
                z = z * math.sqrt(res.sigma2 / max(res.sigma2, noise**2))
            drop = active & (scales < self.threshold)
            if not drop.any():
                for i in range(dim):
                    weak = np.nonzero(active[:, i] & (z[:, i] < self.significance))[0]
                    if len(weak) and active[:, i].sum() > 1:
                        # least significant first; ties (unidentifiable terms) smallest first
                        drop[weak[np.lexsort((scales[weak, i], z[weak, i]))[0]], i] = True
            if not drop.any():
                break
            smaller = active & ~drop
            try:
                res = self._refit(res.coef, smaller, res.x0, res.window,
                                  max_iter=WARM_EVALUATIONS)
            except FitError:
                # the warm start blows up without the dropped terms: start the smaller model
                # from its own weak-form fit; if that blows up too, keep the last model
                try:
                    res = self._refit(weak_lstsq(field, smaller, self.trajectories_), smaller,
                                      None, res.window)
                except FitError:
                    break
            active &= ~drop
            rounds.append({"terms": int(active.sum()), "rss": res.rss})
        return res, active, rounds

    def fit(self, t: Any, X: Any, noise: float | None = None) -> "EquationDiscovery":
        """Discover ``dx/dt = f(x)`` from ``t`` (n,) and ``X`` (n, dim), or lists of them
        (each trajectory with its own, possibly irregular, sample times).

        ``noise`` (fraction of each variable's std) overrides the constructor's. Returns self.
        BLAS runs on one thread meanwhile (the many small dense solves are several times
        slower with more).
        """
        with threadpool_limits(limits=1):
            return self._fit(t, X, noise)

    def _fit(self, t: Any, X: Any, noise: float | None) -> "EquationDiscovery":
        start = time.perf_counter()
        noise = self._prepare(t, X, noise)
        timings: dict[str, float] = {}
        candidates = self._starts(noise, timings, start)
        fitted = [c for c in candidates if "result" in c]
        if not fitted:
            reasons = "; ".join(f"{c['start']}: {c['error']}" for c in candidates)
            raise FitError(
                f"no start could be integrated over windows of {MIN_WINDOW} samples ({reasons})."
                f" The data may be sampled too coarsely for its time scales, or not come from a "
                f"polynomial ODE of degree <= {self.degree}: sample more densely, raise degree, "
                f"or remove outliers")
        with _timed(timings, "stepwise"):
            self._stepwise(fitted, candidates, noise)
        fitted = [c for c in candidates if "result" in c]
        with _timed(timings, "select"):
            best = self._select(fitted)
        with _timed(timings, "simplify"):
            best = self._simplify(best, candidates, noise)
        with _timed(timings, "lengthen"):
            best = self._lengthen(best, candidates, noise)
        self.start_ = best["start"]
        self.rounds_ = best["rounds"]
        self.candidates_ = [{k: v for k, v in c.items() if k not in ("result", "active",
                                                                    "support")}
                            for c in candidates]
        with _timed(timings, "finish"):
            self._finish(best["result"], best["active"])
            self._identify(noise)
        timings["total"] = time.perf_counter() - start
        self.timings_ = timings
        return self

    def _prepare(self, t: Any, X: Any, noise: float | None) -> float | None:
        """Check the settings and data; set the variables, trajectories and monomial library.
        Returns the noise level to use."""
        self._validate()
        trajectories = as_trajectories(t, X, min_points=5)
        dim = trajectories[0][1].shape[1]
        names = [str(v) for v in self.variables] if self.variables is not None \
            else default_variables(dim)
        if len(names) != dim:
            raise SymbolicDataError(f"X has {dim} state columns but {len(names)} variable "
                                    f"names were given: {names}")
        self.variables_ = as_symbols(names)
        self.trajectories_ = trajectories
        self.library_ = monomial_exponents(dim, int(self.degree))
        self._search_rtol = float(self.rtol)
        self._work: int | None = None
        return self.noise if noise is None else noise

    def _starts(self, noise: float | None, timings: dict[str, float], began: float
                ) -> list[dict]:
        """Fit and prune from every start: the Poly-NODE expansion (integral least squares if it
        fails), then each sparse weak-form support not seen yet. One record per start."""
        syms, trajectories = self.variables_, self.trajectories_
        p, dim = len(self.library_), len(syms)
        full = np.ones((p, dim), dtype=bool)
        field = PolyField(syms, self.library_, np.zeros((p, dim)))
        candidates: list[dict] = []
        dense = self._attempt("node", lambda: self._train_node(trajectories, syms), full, noise,
                              candidates)
        timings["node"] = time.perf_counter() - began
        if "error" in dense:
            self._attempt("lstsq", lambda: lstsq_integral(field, full, trajectories), full,
                          noise, candidates)
        explored = {full.tobytes()}
        with _timed(timings, "sparse_starts"):
            # sparsest first: cheap fits finish early, and a finished candidate lets a start
            # that cannot beat it be abandoned before its elimination rounds (:meth:`_hopeless`)
            supports = sorted(sparse_supports(field, trajectories),
                              key=lambda s: int(s[0].sum())) if self.sparse_starts else []
            for active, coef in supports:
                key = active.tobytes()
                if key in explored or any(c.get("support") == key for c in candidates) or \
                        active.sum() > MAX_SPARSE_START * active.size:
                    continue
                explored.add(key)
                self._attempt("weak", coef, active, noise, candidates)
        return candidates

    def _attempt(self, label: str, coef: Any, active: np.ndarray, noise: float | None,
                 candidates: list[dict]) -> dict:
        """Fit from one start (``coef`` or a function computing it) and prune; the record (with
        the error if the start failed) is appended to ``candidates`` and returned."""
        record: dict = {"start": label, "start_terms": int(active.sum())}
        candidates.append(record)
        began = time.perf_counter()
        try:
            coef = coef() if callable(coef) else coef
            if not np.all(np.isfinite(coef)):
                raise FitError(f"the {label} start has non-finite coefficients")
            res = self._fit_safely(coef, active, candidates)
            record["start_converged"] = res.converged
            if not res.converged and active.all():
                raise FitError(f"the dense fit did not converge ({res.message}); a stalled "
                               f"dense fit is no basis for elimination")
            if res.window == self.window and self._hopeless(res, candidates):
                # no model pruned from this start can beat a finished candidate: keep the
                # start's own fit as a record, without spending elimination rounds on it
                kept, rounds = active.copy(), [{"terms": int(active.sum()), "rss": res.rss}]
                record["pruned"] = False
            else:
                res, kept, rounds = self._eliminate(res, active, noise)
        except (FitError, PolynetsError, np.linalg.LinAlgError) as exc:
            record.update(error=str(exc), seconds=time.perf_counter() - began)
            return record
        record.update(seconds=time.perf_counter() - began, terms=int(kept.sum()),
                      rss=res.rss, window=res.window, converged=res.converged, result=res,
                      active=kept, rounds=rounds, support=kept.tobytes())
        return record

    def _hopeless(self, res: ShootingResult, candidates: Sequence[dict]) -> bool:
        """True when ``res`` (a fitted start, on the configured windows or shorter ones) cannot
        lead to the BIC choice: dropping terms or lengthening windows does not lower the
        least-squares residual, so even with one term per equation its criterion,
        ``N ln(RSS / N) + dim ln N``, would exceed that of a finished candidate fitted on the
        configured windows."""
        def length(window: int | None) -> float:
            return math.inf if window is None else float(window)

        finished = [information_criterion(c["result"], c["terms"]) for c in candidates
                    if "result" in c and c["result"].window == self.window]
        if not finished or length(res.window) > length(self.window):
            return False
        return information_criterion(res, res.coef.shape[1]) > min(finished)

    def _stepwise(self, fitted: list[dict], candidates: list[dict], noise: float | None) -> None:
        """Local support search from the candidate of lowest BIC on the configured windows.

        Backward elimination from a start can drop a true term while correlated spurious ones
        stand in for it (``y*z`` for ``y**3`` where an oscillation's amplitude and ``z`` decay
        together; ``x1, x1**2, x2, x2**2`` for ``x2*x4, x3*x4`` on populations near an invariant
        surface), and then no start holds the true support: each single term is insignificant
        next to its stand-ins, so neither elimination nor adding one term finds it. From that
        candidate one evaluation of the sensitivities to every library coefficient gives
        the Gauss-Newton model of the trajectory fit's residual
        (:func:`~symbolic.shooting.local_quadratic`); in it every equation's best support of each
        size is searched (:func:`local_swaps`) with a penalty per term of the residual variance
        times ``max(significance**2, ln N)`` (a term must pass the bar that elimination keeps it
        by and BIC's), the proposal is refit and eliminated again (:meth:`_eliminate`), and joins
        the candidates (start ``"stepwise"``) when its BIC is lower by ``SWAP_EVIDENCE``;
        repeated from it while that holds, at most
        ``STEPWISE_ROUNDS`` times. Selection then treats these candidates like the others.
        Nothing is done when a candidate reproduces the data to about the integration accuracy
        (``SWAP_MIN_RMS``): the data are exact and a model explaining them is at hand."""
        if any(exact_fit(c["result"]) for c in fitted):
            return
        pool = [c for c in fitted if c["result"].window == self.window]
        if not pool:
            return
        best = min(pool, key=lambda c: fit_criterion(c["result"]))
        seen = {c["support"] for c in fitted}
        tried: set[bytes] = set()
        for _ in range(STEPWISE_ROUNDS):
            found = self._step(best, candidates, noise, tried)
            if found is None or found["support"] in seen:
                found = self._pair_step(best, candidates, noise, tried)
            if found is None or found["support"] in seen:
                break
            seen.add(found["support"])
            best = found

    def _local_model(self, res: ShootingResult, active: np.ndarray) -> tuple[np.ndarray, ...]:
        """The Gauss-Newton model ``(S, g, norm)`` of the trajectory fit around ``res``
        (:func:`local_quadratic` at the search tolerance) that the local moves score with."""
        rtol = self._search_rtol
        return local_quadratic(self.library_, res, active, self.trajectories_, rtol=rtol,
                               atol=self.atol * rtol / self.rtol, budget=self._budget())

    def _step(self, best: dict, candidates: list[dict], noise: float | None,
              tried: set[bytes], label: str = "stepwise") -> dict | None:
        """One round of :meth:`_stepwise` from ``best``: the new record (also appended to
        ``candidates``) when its BIC is lower than ``best``'s by ``SWAP_EVIDENCE``, else None.
        A proposed support in ``tried`` (refit before in this search) is not refit again."""
        res, active = best["result"], best["active"]
        try:
            S, g, norm = self._local_model(res, active)
        except (FitError, np.linalg.LinAlgError):
            return None
        sigma2 = max(res.sigma2, EXACT_RMS**2)
        penalty = sigma2 * max(float(self.significance) ** 2, math.log(max(res.n_residuals, 2)))
        proposal, coef = local_swaps(S, g, norm, res.coef, active, penalty)
        if np.array_equal(proposal, active) or proposal.tobytes() in tried:
            return None
        tried.add(proposal.tobytes())
        return self._move(label, proposal, coef, res, candidates, noise)

    def _pair_step(self, best: dict, candidates: list[dict], noise: float | None,
                   tried: set[bytes], label: str = "pair") -> dict | None:
        """A round of pair swaps from ``best`` (when :meth:`_step` finds nothing): the
        ``PAIR_REFITS`` supports two terms away that the Gauss-Newton model predicts to fit best
        (:func:`pair_swaps`; not in ``tried``) are refit and eliminated in turn; the first whose
        BIC is lower than ``best``'s by ``SWAP_EVIDENCE`` is returned (start ``"pair"``, also
        appended to ``candidates``), else None."""
        res, active = best["result"], best["active"]
        try:
            S, g, norm = self._local_model(res, active)
            proposals = pair_swaps(S, g, norm, res.coef, active)
        except (FitError, np.linalg.LinAlgError):
            return None
        proposals = [(support, coef) for _, support, coef in proposals
                     if support.tobytes() not in tried][:PAIR_REFITS]
        for support, coef in proposals:
            tried.add(support.tobytes())
            found = self._move(label, support, coef, res, candidates, noise)
            if found is not None:
                return found
        return None

    def _move(self, label: str, proposal: np.ndarray, coef: np.ndarray, res: ShootingResult,
              candidates: list[dict], noise: float | None) -> dict | None:
        """Refit ``proposal`` warm from ``coef`` (from ``res``'s coefficients if that blows up)
        and eliminate; the record (appended to ``candidates``) when its BIC is lower than
        ``res``'s by ``SWAP_EVIDENCE`` on the same windows, else None (a failed refit is
        recorded with its error)."""
        record: dict = {"start": label, "start_terms": int(proposal.sum())}
        began = time.perf_counter()
        try:
            try:
                moved = self._refit(coef, proposal, res.x0, res.window,
                                    max_iter=WARM_EVALUATIONS)
            except FitError:
                moved = self._refit(res.coef, proposal, res.x0, res.window,
                                    max_iter=WARM_EVALUATIONS)
            record["start_converged"] = moved.converged
            moved, kept, rounds = self._eliminate(moved, proposal, noise)
        except (FitError, PolynetsError, np.linalg.LinAlgError) as exc:
            record.update(error=str(exc), seconds=time.perf_counter() - began)
            candidates.append(record)
            return None
        if moved.window != res.window or \
                fit_criterion(moved) > fit_criterion(res) - SWAP_EVIDENCE:
            return None
        record.update(seconds=time.perf_counter() - began, terms=int(kept.sum()),
                      rss=moved.rss, window=moved.window, converged=moved.converged,
                      result=moved, active=kept, rounds=rounds, support=kept.tobytes())
        candidates.append(record)
        return record

    def _simplify(self, best: dict, candidates: list[dict], noise: float | None) -> dict:
        """Among supports the data cannot tell from the chosen one, the one of simplest terms.

        Under noise a term can have a stand-in of higher degree that fits as well (``y*z`` for
        ``y`` where ``z`` varies little, ``x**2`` for a constant where it only matters near
        ``z = 0``), and which one BIC ranks first is decided by the noise draw. From the chosen
        candidate, each single swap of an active term for an inactive monomial of lower total
        degree that the Gauss-Newton model of the fit (:func:`lower_degree_swaps`) predicts to
        raise the BIC by at most ``PARSIMONY_BIC`` is refit and eliminated (:meth:`_eliminate`);
        the first whose BIC (on the configured windows, converged) is within ``PARSIMONY_BIC``
        of the chosen candidate's replaces it (start ``"simpler"``, also recorded in
        ``candidates``), and the search repeats from there, at most ``STEPWISE_ROUNDS`` times.
        When no single swap is accepted, pairs of swaps of lower total degree are proposed the
        same way (:meth:`_simpler`, :func:`pair_swaps`): a stand-in that gives way only together
        with a companion term, e.g. under a conservation law.
        The bound is to the chosen candidate, so repeated swaps cannot drift away from what the
        data support. Nothing is done on exact data (``SWAP_MIN_RMS``) or for a candidate on
        shorter windows."""
        res, active = best["result"], best["active"]
        if res.window != self.window or \
                exact_fit(res):
            return best
        bound = fit_criterion(res) + PARSIMONY_BIC
        degrees = self.library_.sum(axis=1)
        tried: set[bytes] = {active.tobytes()}
        for _ in range(STEPWISE_ROUNDS):
            try:
                S, g, norm = self._local_model(res, active)
            except (FitError, np.linalg.LinAlgError):
                break
            tolerance = PARSIMONY_BIC * res.rss / max(res.n_residuals, 1)
            found = None
            for support, coef in self._simpler(S, g, norm, res.coef, active, degrees,
                                               tolerance, tried):
                began = time.perf_counter()
                try:
                    moved = self._refit(coef, support, res.x0, res.window,
                                        max_iter=WARM_EVALUATIONS)
                    moved, kept, rounds = self._eliminate(moved, support, noise)
                except (FitError, PolynetsError, np.linalg.LinAlgError):
                    continue
                if moved.window != self.window or not moved.converged or \
                        fit_criterion(moved) > bound:
                    continue
                found = {"start": "simpler", "start_terms": int(support.sum()),
                         "start_converged": True, "seconds": time.perf_counter() - began,
                         "terms": int(kept.sum()), "rss": moved.rss, "window": moved.window,
                         "converged": moved.converged, "criterion": fit_criterion(moved),
                         "result": moved, "active": kept, "rounds": rounds,
                         "support": kept.tobytes()}
                candidates.append(found)
                break
            if found is None:
                break
            best, res, active = found, found["result"], found["active"]
            tried.add(active.tobytes())
        return best

    @staticmethod
    def _simpler(S: np.ndarray, g: np.ndarray, norm: np.ndarray, coef: np.ndarray,
                 active: np.ndarray, degrees: np.ndarray, tolerance: float, tried: set[bytes]
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Proposals of :meth:`_simplify`, each support not in ``tried`` (added as it is
        yielded): up to ``SIMPLIFY_REFITS`` single swaps (:func:`lower_degree_swaps`), then, while
        the caller asks for more, up to ``SIMPLIFY_REFITS`` pair swaps of lower total degree
        (:func:`pair_swaps`): a stand-in that only gives way together with a companion term
        (``1, S`` written as ``I**2, R`` through a conserved ``S + E + I + R = 1``)."""
        singles = lower_degree_swaps(S, g, norm, coef, active, degrees, tolerance)
        for group in (singles, None):
            if group is None:
                group = pair_swaps(S, g, norm, coef, active, degrees=degrees,
                                   tolerance=tolerance)
            count = 0
            for _, support, new in group:
                if count == SIMPLIFY_REFITS:
                    break
                if support.tobytes() in tried:
                    continue
                tried.add(support.tobytes())
                count += 1
                yield support, new

    def _lengthen(self, best: dict, candidates: list[dict], noise: float | None) -> dict:
        """Check the chosen support on longer windows, and search for a better one there where
        it does not hold.

        A stand-in term (``x*z`` for ``x**3`` where ``z`` decays with the oscillation's
        amplitude) can fit each short window as well as the true term, so that on the configured
        windows no swap has the evidence :meth:`_stepwise` asks for; over longer windows the
        stand-in drifts and the true support fits clearly better. From the chosen candidate,
        the support is refit on windows ``polish`` times longer, again and again (warm from the
        shorter fit's smoothed states, as in :meth:`_finish`), while the longer windows fit the
        data as well (:func:`continuity_holds`). At the first length where a converged fit does
        not (one that does not converge, e.g. a chaotic trajectory over too long a window, is no
        basis for a search and ends it), the Gauss-Newton model of the fit on those windows is
        searched for swaps (:meth:`_step`, and
        :meth:`_pair_step` when that finds none); a proposal refit and eliminated on those
        windows is kept (start ``"longer"``) when its BIC there is lower by ``SWAP_EVIDENCE``
        than the chosen support's and lower than the chosen support's on the last windows it
        held on (every fitted window start counted: the proposal explains the data with fewer
        free starts), and the lengthening goes on from it, at most ``STEPWISE_ROUNDS`` swaps.
        Nothing is done on exact data (``SWAP_MIN_RMS``), without ``polish`` or for a
        candidate on shorter windows. Returns the candidate to finish."""
        res, active = best["result"], best["active"]
        if self.window is None or int(self.polish) <= 1 or res.window != self.window or \
                exact_fit(res):
            return best
        longest = max(len(t) for t, _ in self.trajectories_)
        window, swaps = int(res.window), 0
        tried: set[bytes] = {active.tobytes()}
        while window < longest and swaps < STEPWISE_ROUNDS:
            window *= int(self.polish)
            longer = self._refit_longer(res, active, window, exact=False)
            if longer is None:
                break
            if continuity_holds(longer, res, self._search_rtol):
                res = longer
                continue
            here = {"result": longer, "active": active}
            try:
                found = self._step(here, candidates, noise, tried, label="longer")
                if found is None:
                    found = self._pair_step(here, candidates, noise, tried, label="longer")
            except (FitError, PolynetsError, np.linalg.LinAlgError):
                break
            if found is None or not found["result"].converged or \
                    fit_criterion(found["result"]) >= fit_criterion(res):
                break
            best, res, active = found, found["result"], found["active"]
            tried.add(active.tobytes())
            swaps += 1
        return best

    def _refit_longer(self, res: ShootingResult, active: np.ndarray, window: int, *,
                      exact: bool) -> ShootingResult | None:
        """``active`` refit on ``window``-sample windows, warm from the coefficients of ``res``
        and its smoothed states (``WARM_EVALUATIONS`` evaluations); None where the fit fails
        or does not converge (the lengthening of :meth:`_lengthen` and :meth:`_finish` stops
        there)."""
        try:
            longer = self._refit(res.coef, active, self._window_starts(res, window), window,
                                 exact=exact, max_iter=WARM_EVALUATIONS)
        except FitError:
            return None
        return longer if longer.converged else None

    def _finish(self, res: ShootingResult, active: np.ndarray) -> None:
        """The chosen support refit at the exact tolerances, then on windows ``polish`` times
        longer than its own (the configured ones, or those :meth:`_lengthen` found it on), again
        and again up to whole trajectories, while the longer windows fit the data
        as well (:func:`continuity_holds`) or are the better estimate by the selection
        criterion (:func:`no_worse_longer`; each a warm refit of ``WARM_EVALUATIONS``
        evaluations from the shorter fit's states);
        on exact data, refit at tighter tolerances (:meth:`_sharpen`); terms at round-off level
        set to zero (:func:`drop_roundoff`), coefficients snapped; sets the results."""
        if self._search_rtol > self.rtol:
            res = self._refit(res.coef, active, res.x0, res.window, exact=True)
        self.fit_window_ = res.window
        if self.window is not None and self.polish > 1 and res.window is not None and \
                res.window >= self.window:
            longest = max(len(t) for t, _ in self.trajectories_)
            window = int(res.window)
            while window < longest:
                window *= int(self.polish)
                longer = self._refit_longer(res, active, window, exact=True)
                if longer is None or not (continuity_holds(longer, res, self.rtol) or
                                          no_worse_longer(longer, res, self.rtol)):
                    break
                res = longer
                self.fit_window_ = longer.window
        res = self._reweight(res, active)
        res = self._sharpen(res, active)
        coef = drop_roundoff(res.coef, self.library_, self.trajectories_)
        if self.snap_tol is not None:
            coef = snap_coefficients(coef, self.snap_tol)
        self.coef_ = coef
        self.x0_ = res.x0
        self.result_ = res
        self.converged_ = res.converged

    def _identify(self, noise: float | None) -> None:
        """Sets ``relations_``: the linear relations among the library's monomials that the fit
        data satisfy up to round-off or up to the noise the final fit estimates
        (``state_noise_``, floored at ``noise`` times each state's std where given;
        :func:`library_relations`; on exact data, a residual at the integration tolerance as in
        :meth:`_sharpen`, what is left is integration error, not white noise, and only single
        samples are tested; on noisy data only linear relations, conservation laws, are
        sought), as sympy expressions equal to zero on the data. Where there
        are any, the model is not identifiable from these data (models that differ by multiples
        of a relation fit them equally well) and an
        :class:`~symbolic.errors.IdentifiabilityWarning` names them; the model is left as
        chosen."""
        stacked = np.concatenate([X for _, X in self.trajectories_])
        sigma = np.zeros(stacked.shape[1]) if self.state_noise_ is None else \
            np.asarray(self.state_noise_, dtype=np.float64)
        if noise:
            sigma = np.maximum(sigma, float(noise) * stacked.std(axis=0))
        res = self.result_
        exact = at_tolerance(res, self.rtol)
        noisy = bool(noise) or not exact
        try:
            # on noisy data, conservation laws (linear relations) only: near-relations of
            # higher degree along a trajectory hide in the noise as well as true ones
            found = library_relations(self.library_, self.trajectories_, sigma, white=noisy,
                                      max_degree=1 if noisy else None)
        except np.linalg.LinAlgError:          # an SVD that does not converge: nothing to say
            found = []
        monomials = PolyField(self.variables_, self.library_,
                              np.zeros((len(self.library_), 1))).monomials()
        self.relations_ = [sympy.Add(*[(sympy.Integer(1) if k == pivot else
                                        sympy.Float(float(c[k]), 17)) * monomials[k]
                                       for k in np.nonzero(c)[0]])
                           for c, pivot, _ in found]
        if found:
            warnings.warn(relations_message(found, monomials), IdentifiabilityWarning,
                          stacklevel=4)

    def _reweight(self, res: ShootingResult, active: np.ndarray) -> ShootingResult:
        """Weight each state's residuals by its own noise level (feasible generalised least
        squares) where the levels differ.

        Every fit divides a state's residuals by its standard deviation: the maximum-likelihood
        fit when each state's noise is proportional to its spread. Where it is not (sensors of
        different precision), the state with the larger relative noise pulls the coefficients
        towards its noise. The noise of every state is estimated from the residuals of the
        final fit (:func:`~symbolic.shooting.state_noise`; no noise level is needed); when the
        levels, in units of the scale the fit used, differ beyond chance (:func:`unequal_noise`)
        the support is refit, warm, on the same windows, with each state's residuals divided by
        its estimated level (:func:`noise_scale`), and kept if it converges; the levels are
        estimated again from that fit, and the refit repeated while they still differ from the
        weights used beyond chance, at most ``REWEIGHT_ROUNDS`` times (the first estimate carries
        the coefficient error the noisier state pulled into the quieter one's residuals). Exact
        data (residual at the integration tolerance, as in :meth:`_sharpen`) is left alone.
        Sets ``state_noise_`` (the estimate from the fit that is kept) and ``residual_scale_``.
        """
        self.residual_scale_ = res.scale
        try:
            noise = state_noise(res, self.trajectories_)
        except FitError:
            self.state_noise_ = None
            return res
        self.state_noise_ = noise
        samples = sum(len(t) for t, _ in self.trajectories_)
        if at_tolerance(res, self.rtol) or \
                res.scale is None or not unequal_noise(noise, res.scale, samples):
            return res
        spread = residual_scale(self.trajectories_)
        for _ in range(REWEIGHT_ROUNDS):
            scale = noise_scale(noise, spread)
            try:
                weighted = fit_trajectories(self.library_, res.coef, active, self.trajectories_,
                                            window=res.window, x0=res.x0, rtol=self.rtol,
                                            atol=self.atol, max_iter=WARM_EVALUATIONS,
                                            scale=scale)
            except FitError:
                break
            if not weighted.converged:
                break
            res, noise = weighted, state_noise(weighted, self.trajectories_)
            self.residual_scale_, self.state_noise_ = scale, noise
            if not unequal_noise(noise, scale, samples):
                break
        return res

    def _sharpen(self, res: ShootingResult, active: np.ndarray) -> ShootingResult:
        """On data the model reproduces to about the integration tolerance (residual RMS within
        ``1 / SEARCH_RTOL_FACTOR`` of ``rtol``: exact data, as in :func:`continuity_holds`) the
        coefficients are limited by the integrator, not by the data: refit with ``rtol`` (and
        ``atol``) ten times tighter, down to ``FINEST_RTOL``, while each step lowers the residual
        sum of squares by more than ``SHARPEN_GAIN``. A refit that does not converge or fits
        worse is not kept. Noisy data (residual far above the tolerance) is left as it is."""
        rtol = float(self.rtol)
        while rtol > FINEST_RTOL and at_tolerance(res, rtol):
            rtol = max(rtol / 10.0, FINEST_RTOL)
            try:
                finer = fit_trajectories(self.library_, res.coef, active, self.trajectories_,
                                         window=res.window, x0=res.x0, rtol=rtol,
                                         atol=self.atol * rtol / self.rtol,
                                         max_iter=WARM_EVALUATIONS)
            except FitError:
                break
            if not (finer.converged and finer.rss <= res.rss):
                break
            gain = res.rss / max(finer.rss, 1e-300)
            res = finer
            if gain <= SHARPEN_GAIN:
                break
        return res

    def _window_starts(self, res: ShootingResult, window: int) -> np.ndarray | None:
        """Initial states of ``window``-sample windows read from the fitted model states of
        ``res`` (the data smoothed by the fit), instead of the noisy first samples."""
        if res.states is None:
            return None
        smoothed = [(t, S) for (t, _), S in zip(self.trajectories_, res.states)]
        return np.array([Sw[0] for _, Sw in make_windows(smoothed, window)])

    def _select(self, fitted: list[dict]) -> dict:
        """Choose among the candidates; returns the chosen one.

        Every candidate gets its ``criterion`` (BIC) on the configured windows; a candidate
        fitted on shorter windows is refit on them first (if it blows up there, it is compared on
        its own windows). The criterion counts every free parameter of the fit, the window
        starts with the terms: on shorter windows more starts absorb noise and lower the
        residual, so a candidate left on them pays for its extra starts instead of winning by
        them (on equal windows the starts are the same for all and the ranking is that of the
        terms). ``selection="bic"`` takes the lowest BIC; ``"cv"`` the lowest held-out window
        error (:func:`held_out_error`, stored as ``cv``) of all distinct supports; ``"bic+cv"``
        the lowest held-out error among the ``CV_SHORTLIST`` distinct supports of lowest BIC
        when it beats the BIC choice's by more than two standard errors (of a mean square over
        the held-out residuals), else the BIC choice. Held-out errors are compared only between
        fits on the same windows as the BIC choice (shorter windows predict their held-out
        samples from nearer fitted starts). Under ``"bic+cv"`` a BIC choice that reproduces the
        data to about the integration accuracy (residual RMS below ``SWAP_MIN_RMS``: exact data)
        stands: held-out errors there are integration error, not evidence (on Sprott's case N
        they preferred the true terms plus ``-7e-15 y*z``, fitted at a looser tolerance, to the
        true terms alone).
        """
        for c in fitted:
            res = c["result"]
            if res.window != self.window:
                try:
                    res = self._refit(res.coef, c["active"], None, self.window)
                    c["result"], c["window"], c["rss"] = res, res.window, res.rss
                except FitError:
                    pass
            c["criterion"] = fit_criterion(res)
        ranked, seen = [], set()
        for c in sorted(fitted, key=lambda c: c["criterion"]):
            if c["support"] not in seen:
                seen.add(c["support"])
                ranked.append(c)
        if self.selection == "bic" or len(ranked) == 1 or (
                self.selection == "bic+cv" and exact_fit(ranked[0]["result"])):
            return ranked[0]
        same = [c for c in ranked if c["result"].window == ranked[0]["result"].window]
        shortlist = same if self.selection == "cv" else same[:CV_SHORTLIST]
        rtol = self._search_rtol
        per_window = {}
        for c in shortlist:
            c["cv"], per_window[id(c)] = held_out_error(
                self.library_, c["result"], c["active"], self.trajectories_, rtol=rtol,
                atol=self.atol * rtol / self.rtol, budget=self._budget(), per_window=True)
        best = min(shortlist, key=lambda c: (c["cv"], c["criterion"]))
        if self.selection == "cv" or best is ranked[0]:
            return best
        # BIC's choice stands unless the held-out error is clearly lower elsewhere: by more than
        # two standard errors of a mean square over the held-out residuals, and by more than two
        # standard errors of the window-by-window differences (held-out residuals are correlated
        # within a window, and a few windows, e.g. a transient, can carry most of the
        # information: then one fold's refit is poorly determined and its errors are not
        # independent evidence); a BIC choice whose cross-validation blew up (a refit on half
        # the windows diverged) leaves it undecided
        n = max(ranked[0]["result"].n_residuals, 1)
        if not math.isfinite(ranked[0]["cv"]):
            return ranked[0]
        if best["cv"] < ranked[0]["cv"] * (1.0 - 2.0 * math.sqrt(2.0 / n)) and \
                clearly_lower(per_window[id(best)], per_window[id(ranked[0])]):
            return best
        return ranked[0]

    # ------------------------------------------------------------------------------- results
    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "coef_")

    def _check(self) -> None:
        if not self.__sklearn_is_fitted__():
            raise NotFittedError("this EquationDiscovery is not fitted yet; call fit(t, X) first")

    @property
    def field_(self) -> PolyField:
        """The discovered vector field as a :class:`~symbolic.field.PolyField`."""
        self._check()
        return PolyField(self.variables_, self.library_, self.coef_)

    def rhs(self) -> list[sympy.Expr]:
        """Right-hand sides ``f_i(x)`` as sympy expressions (float coefficients)."""
        return self.field_.to_exprs()

    def equations(self) -> list[sympy.Eq]:
        """``[Eq(dx/dt, f_x), ...]`` with ``dx/dt`` a sympy Symbol."""
        self._check()
        return [sympy.Eq(derivative_symbol(v), e) for v, e in zip(self.variables_, self.rhs())]

    def coefficients(self) -> list[dict[str, float]]:
        """Per equation ``{str(monomial): coefficient}`` of the kept terms."""
        field = self.field_
        names = [str(m) for m in field.monomials()]
        return [{n: float(c) for n, c in zip(names, field.coef[:, i]) if c != 0.0}
                for i in range(field.coef.shape[1])]

    def simulate(self, x0: Any, t: Any) -> np.ndarray:
        """Integrate the discovered ODE from ``x0`` (dim,) at times ``t`` (n,) -> (n, dim).

        DOP853 at the refit tolerances; rows after a blow-up are NaN.
        """
        field = self.field_
        x0 = np.asarray(x0, dtype=np.float64).reshape(-1)
        t = np.asarray(t, dtype=np.float64)
        if x0.shape != (field.dim,):
            raise SymbolicDataError(f"x0 must have {field.dim} entries, got {x0.shape[0]}")
        as_trajectories(t, np.zeros((len(t), field.dim)), min_points=1)
        out = np.full((len(t), field.dim), np.nan)
        out[0] = x0
        if len(t) == 1:
            return out
        sol = solve_ivp(lambda _t, x: field(x[None])[0], (t[0], t[-1]), x0, method="DOP853",
                        t_eval=t, rtol=self.rtol, atol=self.atol)
        out[: sol.y.shape[1]] = sol.y.T
        return out

    def score(self, t: Any, X: Any) -> float:
        """Coefficient of determination of simulated windows against ``X``.

        Every window (of the final fit's length) is simulated from its first observed state;
        returns ``1 - SS_res / SS_tot`` over all samples (``-inf`` if a simulation blows up).
        """
        self._check()
        trajectories = as_trajectories(t, X, dim=self.field_.dim)
        res, tot = 0.0, 0.0
        stacked = np.concatenate([Xi for _, Xi in trajectories])
        mean = stacked.mean(axis=0)
        for tw, Xw in make_windows(trajectories, self.fit_window_):
            sim = self.simulate(Xw[0], tw)
            if not np.all(np.isfinite(sim)):
                return -math.inf
            res += float(np.sum((sim - Xw) ** 2))
            tot += float(np.sum((Xw - mean) ** 2))
        return 1.0 - res / tot if tot > 0 else -math.inf

    def to_latex(self, digits: int = 6) -> str:
        """The equations as a LaTeX ``aligned`` block."""
        return to_latex(self.rhs(), self.variables_, digits=digits)

    def to_python(self, name: str = "vector_field") -> str:
        """Source of ``def name(t, state)`` returning the right-hand sides."""
        return to_python(self.rhs(), self.variables_, name=name)

    def __str__(self) -> str:
        if not hasattr(self, "coef_"):
            return f"EquationDiscovery(degree={self.degree}, not fitted)"
        return to_string(self.rhs(), self.variables_)

    def print(self, digits: int = 6) -> None:
        """Print one ``dx/dt = ...`` line per equation."""
        self._check()
        print(to_string(self.rhs(), self.variables_, digits=digits))
