"""Rotary position embeddings, in the two layouts the families use.

* Interleaved (Meta's Llama layout): channels ``(2i, 2i+1)`` form the pair rotated at frequency
  ``i``; the table is ``[max_seq_len, head_dim // 2, 2]``, the (cos, sin) of each pair.
* Half-split (``transformers``' ``rotate_half``, Qwen3): channel ``i`` pairs with channel
  ``i + head_dim / 2``; the table is ``[max_seq_len, 2, head_dim]``, rows ``cos`` and
  ``(-sin, sin)`` over both halves.

Frequencies and angles are computed in float64 (long contexts keep their precision) and tables
stored as float32: real tensors, so ``model.to(dtype)`` cannot drop an imaginary part. The
rotation runs in float32 and keeps the input dtype. Tables are position-major, so context
parallel keeps the rows of the positions a rank holds.
"""

from __future__ import annotations

import math

import torch


def inv_freqs(
    head_dim: int, theta: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """``theta ** (-2i / head_dim)`` for ``i < head_dim / 2``, float64."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    return 1.0 / (theta**exponents)


def llama3_scaled(
    freqs: torch.Tensor, original_max_seq_len: int, low: float, high: float, factor: float
) -> torch.Tensor:
    """The Llama 3.1 rule: components whose wavelength is shorter than
    ``original_max_seq_len / high`` are unchanged, those longer than
    ``original_max_seq_len / low`` are divided by ``factor``, and the band in between interpolates
    smoothly (in wavelength-ratio space) between the two."""
    wavelen = 2 * math.pi / freqs
    # smooth = 1 keeps a frequency, smooth = 0 divides it by the factor.
    smooth = ((float(original_max_seq_len) / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1.0 - smooth) * freqs / factor + smooth * freqs


def angles(freqs: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """``[max_seq_len, len(freqs)]`` float64: position times frequency."""
    positions = torch.arange(max_seq_len, dtype=torch.float64, device=freqs.device)
    return torch.outer(positions, freqs)


def interleaved_table(theta: torch.Tensor) -> torch.Tensor:
    """``[T, head_dim // 2, 2]`` float32 from ``angles``: the unit rotations
    ``exp(i * angle)`` as (real, imaginary) pairs (Meta's ``freqs_cis`` seen by
    ``torch.view_as_real``)."""
    return torch.stack((theta.cos(), theta.sin()), dim=-1).to(torch.float32)


def apply_interleaved(
    xq: torch.Tensor, xk: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys ``[B, T, ..., head_dim]`` (position in dim 1, any head dims) by
    their position (0..T-1): one complex multiply by the cached unit rotation per pair, no
    per-call stacking."""
    # [T, head_dim // 2] complex64: a view of the table, no copy
    rotation = torch.view_as_complex(table[: xq.shape[1]].float())

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        turned = pairs * rotation.view(x.shape[1], *(1,) * (x.ndim - 3), -1)
        return torch.view_as_real(turned).flatten(-2).type_as(x)

    return rotate(xq), rotate(xk)


def half_split_table(theta: torch.Tensor) -> torch.Tensor:
    """``[T, 2, head_dim]`` float32 from ``angles``: row 0 ``cos`` of both halves, row 1
    ``(-sin, sin)``, so the rotation is two multiplies and an add."""
    cos, sin = theta.cos(), theta.sin()
    return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), 1).float()


def apply_half_split(
    xq: torch.Tensor, xk: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys ``[B, T, ..., head_dim]`` by their position (0..T-1):
    ``x * cos + swap_halves(x) * (-sin, sin)``."""
    rows = table[: xq.shape[1]]  # [T, 2, head_dim]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[1], *(1,) * (x.ndim - 3), -1)  # broadcast over the head dims
        cos, signed_sin = rows[:, 0].view(shape), rows[:, 1].view(shape)
        x32 = x.float()
        first, second = x32.chunk(2, dim=-1)
        return (x32 * cos + torch.cat((second, first), dim=-1) * signed_sin).type_as(x)

    return rotate(xq), rotate(xk)


def apply_partial_half_split(
    xq: torch.Tensor, xk: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_half_split` on the first ``table.shape[-1]`` channels of each head only (the
    rest pass unrotated: ``partial_rotary_factor``, Qwen3-Next rotates a quarter of each head)."""
    width = table.shape[-1]
    if width == xq.shape[-1]:
        return apply_half_split(xq, xk, table)
    q_rot, k_rot = apply_half_split(xq[..., :width], xk[..., :width], table)
    return (
        torch.cat([q_rot, xq[..., width:]], dim=-1),
        torch.cat([k_rot, xk[..., width:]], dim=-1),
    )


def yarn_inv_freqs(
    head_dim: int,
    theta: float,
    factor: float,
    original_max_seq_len: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN's "NTK-by-parts" frequencies (arXiv 2309.00071, as DeepSeek-V2/V3 publish them),
    float64: pairs that turn more than ``beta_fast`` times over ``original_max_seq_len`` keep
    their frequency, those turning fewer than ``beta_slow`` times are divided by ``factor``, and
    a linear ramp over the pair index blends the two in between. ``truncate``: the ramp's ends
    rounded outward to whole pairs (DeepSeek); gpt-oss publishes ``truncate: false`` (its ends
    8.09 and 17.40 as they are), as ``transformers``' ``rope_parameters["truncate"]``."""

    def pair_turning(turns: float) -> float:  # the pair index that turns ``turns`` times
        return (
            head_dim
            * math.log(original_max_seq_len / (turns * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    freqs = inv_freqs(head_dim, theta)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
    keep = 1.0 - ramp.clamp(0.0, 1.0)  # 1: the original frequency, 0: divided by the factor
    return freqs / factor * (1.0 - keep) + freqs * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 without scaling). MLA
    multiplies its softmax scale by the square of ``yarn_mscale(factor, mscale_all_dim)``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
