"""Verification math: greedy prefix matching and speculative (rejection) sampling.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) verifies draft
tokens x_1..x_k drawn from draft distributions q_1..q_k against the target
distributions p_1..p_{k+1}: x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection a token is drawn from the
residual max(0, p_i - q_i) (normalised) and the rest is discarded; if all k are
accepted a bonus token is drawn from p_{k+1}. Every emitted token is then
distributed exactly as p given the tokens before it. DSpark's drafts are the
MTP's argmax, a deterministic function of the prefix, i.e. q_i is the point mass
on x_i: acceptance is p_i(x_i) and the residual is p_i without x_i.

Randomness is keyed per request by (seed, output index), like the sampler's, so
a seeded request is reproducible and a token's draw does not depend on the batch.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from redknot.sample.noise import mix_seed

# Keys the acceptance uniforms apart from the sampler's exponential noise of the same output index.
_ACCEPT_SALT = 0x5EC7_A11C_E5


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
    """[k, V] one-hot draft distributions of deterministic drafts."""
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


def speculative_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: Sequence[int],
                       uniforms: Sequence[float], noise: torch.Tensor) -> List[int]:
    """Accepted drafts followed by one residual or bonus token (see the module docstring).

    target_probs [k+1, V] and draft_probs [k, V] are distributions (rows sum to 1);
    uniforms: k acceptance coins in [0, 1); noise [k+1, V] positive Exp(1) draws, so that
    ``argmax(w / noise[i])`` samples proportionally to the weights w.
    """
    k = len(draft_token_ids)
    if target_probs.shape[0] != k + 1 or draft_probs.shape[0] != k or len(uniforms) != k:
        raise ValueError(f"speculative_sample: {k} drafts need {k + 1} target rows, {k} draft rows and "
                         f"{k} uniforms; got {target_probs.shape[0]}, {draft_probs.shape[0]}, {len(uniforms)}")
    out: List[int] = []
    for i, x in enumerate(draft_token_ids):
        p_x, q_x = float(target_probs[i, x]), float(draft_probs[i, x])
        if q_x <= 0.0:
            raise ValueError(f"draft {i} (token {x}) has probability 0 under its own draft distribution")
        if uniforms[i] < min(1.0, p_x / q_x):
            out.append(int(x))
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0.0)  # [V]; mass >= q_x - p_x > 0
        out.append(int((residual / noise[i]).argmax()))
        return out
    out.append(int((target_probs[k] / noise[k]).argmax()))
    return out
