"""Verification math: greedy prefix matching, token-wise and block verification (reference
dspark.md §3.2-3.3).

A request verifies drafts x_1..x_l drawn from draft distributions q_1..q_l against the
target distributions p_1..p_{l+1} (row i of ``p``: the target's distribution of the token
after draft i; row 0 after the request's last real token).

* Token-wise (Leviathan et al. 2023): x_i is kept with probability min(1, p_i(x_i)/q_i(x_i));
  at the first rejection the next token comes from norm(max(p_i - q_i, 0)); with every draft
  kept the bonus token comes from p_{l+1}.
* Block (Sun et al., arXiv 2403.10444): running ratio r_0 = 1, r_i = min(1, r_{i-1} p_i(x_i) /
  q_i(x_i)); for i < l the one-ahead residual mass m_i = sum_y max(r_i p_{i+1}(y) - q_{i+1}(y), 0)
  gives h_i = m_i / (m_i + 1 - r_i) (1 when the denominator is 0), and h_l = r_l. With
  independent eta_i in (0, 1], tau = max{i : eta_i <= h_i} (0 if none) drafts are kept; the
  next token comes from norm(max(r_tau p_{tau+1} - q_{tau+1}, 0)), or from p_{l+1} when tau = l.

Both keep every emitted token distributed as the target given the tokens before it, also when
the number of verified drafts l is chosen without looking at the drafts it admits (§3.4).
The functions return the number kept and the distribution the next token is drawn from, so
the same code runs on torch tensors in the engine and on numpy arrays of exact fractions in
the enumeration tests. Randomness is keyed per request by (seed, output index).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence

import torch

from redknot.sample.noise import mix_seed

# Keys the acceptance uniforms apart from the sampler's exponential noise of the same output index.
_ACCEPT_SALT = 0x5EC7_A11C_E5


@dataclass
class Outcome:
    """What verification decided for one request: ``num_accepted`` drafts are kept and the next
    token is drawn from ``next_dist`` (a [V] distribution: residual or bonus)."""
    num_accepted: int
    next_dist: Any


def _item(v: Any) -> Any:
    """A scalar out of a tensor element (fractions and floats pass through)."""
    return v.item() if isinstance(v, torch.Tensor) else v


def _positive_part(d: Any) -> Any:
    return (d + abs(d)) / 2  # max(d, 0) elementwise, for tensors and object arrays alike


def _normalized(w: Any, fallback: Any) -> Any:
    total = _item(w.sum())
    return w / total if total > 0 else fallback


def greedy_accept(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> List[int]:
    """The longest prefix of the drafts that equals the target's tokens, then the target's
    token after it. ``target_token_ids`` has one more entry than the drafts."""
    out: List[int] = []
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        out.append(int(draft))
    out.append(int(target_token_ids[len(out)]))
    return out


def point_mass(token_ids: Sequence[int], vocab: int, device) -> torch.Tensor:
    """[k, V] one-hot draft distributions of greedy drafts."""
    q = torch.zeros(len(token_ids), vocab, dtype=torch.float32, device=device)  # [k, V]
    if len(token_ids):
        q[torch.arange(len(token_ids), device=device), torch.tensor(list(token_ids), device=device)] = 1.0
    return q


def accept_uniforms(seed: int, output_indices: Sequence[int]) -> List[float]:
    """U[0, 1) draws keyed by (seed, output index): the acceptance coin of each draft."""
    gen = torch.Generator()
    out = []
    for index in output_indices:
        gen.manual_seed(mix_seed(seed ^ _ACCEPT_SALT, int(index)))
        out.append(float(torch.rand((), generator=gen)))
    return out


def _check(p: Any, q: Any, drafts: Sequence[int], coins: Sequence[Any]) -> None:
    k = len(drafts)
    if p.shape[0] != k + 1 or q.shape[0] != k or len(coins) != k:
        raise ValueError(f"verification of {k} drafts needs {k + 1} target rows, {k} draft rows and {k} "
                         f"uniforms; got {p.shape[0]}, {q.shape[0]}, {len(coins)}")


def verify_tokenwise(p: Any, q: Any, drafts: Sequence[int], uniforms: Sequence[Any]) -> Outcome:
    """Token-wise verification; ``uniforms[i]`` in [0, 1) is draft i's acceptance coin."""
    _check(p, q, drafts, uniforms)
    for i, x in enumerate(drafts):
        p_x, q_x = _item(p[i, x]), _item(q[i, x])
        if not q_x > 0:
            raise ValueError(f"draft {i} (token {x}) has probability 0 under its own draft distribution")
        if uniforms[i] < min(1, p_x / q_x):
            continue
        return Outcome(i, _normalized(_positive_part(p[i] - q[i]), p[i]))
    return Outcome(len(drafts), p[len(drafts)])


def block_thresholds(p: Any, q: Any, drafts: Sequence[int]) -> List[Any]:
    """[(r_i, h_i) for i = 1..l] of block verification: running ratio and acceptance threshold."""
    out, ratio, k = [], 1, len(drafts)
    for i, x in enumerate(drafts):
        q_x = _item(q[i, x])
        if not q_x > 0:
            raise ValueError(f"draft {i} (token {x}) has probability 0 under its own draft distribution")
        ratio = min(1, ratio * _item(p[i, x]) / q_x)
        if i + 1 == k:
            out.append((ratio, ratio))
            break
        mass = _item(_positive_part(ratio * p[i + 1] - q[i + 1]).sum())
        denom = mass + 1 - ratio
        out.append((ratio, mass / denom if denom > 0 else 1))
    return out


def verify_block(p: Any, q: Any, drafts: Sequence[int], etas: Sequence[Any]) -> Outcome:
    """Block verification; ``etas[i]`` in (0, 1] is the coin of block position i + 1."""
    _check(p, q, drafts, etas)
    steps = block_thresholds(p, q, drafts)
    tau = 0
    for i, (_, h) in enumerate(steps):
        if etas[i] <= h:
            tau = i + 1  # a later success overrides an earlier failure
    k = len(drafts)
    if tau == k:
        return Outcome(k, p[k])
    ratio = steps[tau - 1][0] if tau else 1
    return Outcome(tau, _normalized(_positive_part(ratio * p[tau] - q[tau]), p[tau]))


def sample_from(dist: torch.Tensor, noise: torch.Tensor) -> int:
    """``argmax(dist / noise)`` with Exp(1) ``noise``: a draw proportional to ``dist``."""
    return int((dist / noise).argmax())


def speculative_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: Sequence[int],
                       uniforms: Sequence[float], noise: torch.Tensor) -> List[int]:
    """Token-wise verification with its token draws: accepted drafts + one residual or bonus token.
    ``noise`` [k+1, V]: positive Exp(1) draws, row i for the token at block position i + 1."""
    out = verify_tokenwise(target_probs, draft_probs, draft_token_ids, uniforms)
    kept = [int(t) for t in draft_token_ids[:out.num_accepted]]
    return kept + [sample_from(out.next_dist, noise[out.num_accepted])]


def block_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: Sequence[int],
                 uniforms: Sequence[float], noise: torch.Tensor) -> List[int]:
    """Block verification with its token draws (``uniforms`` in [0, 1) become eta = 1 - u in (0, 1])."""
    out = verify_block(target_probs, draft_probs, draft_token_ids, [1.0 - u for u in uniforms])
    kept = [int(t) for t in draft_token_ids[:out.num_accepted]]
    return kept + [sample_from(out.next_dist, noise[out.num_accepted])]
