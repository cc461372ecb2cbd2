"""``build_loader(**keywords)``: a data loader from one flat set of keywords, as the tests write
them: the :class:`~torchtitan.data.loader.DataSpec` fields go to the spec, the rest (tokenizer,
batch sizes, ranks) to ``build_hf_dataloader``."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.data.loader import DataSpec, HFDataLoader, build_hf_dataloader

SPEC_FIELDS = {f.name for f in dataclasses.fields(DataSpec)}


def build_loader(**keywords: Any) -> HFDataLoader:
    spec = DataSpec(**{k: v for k, v in keywords.items() if k in SPEC_FIELDS})
    rest = {k: v for k, v in keywords.items() if k not in SPEC_FIELDS}
    return build_hf_dataloader(spec, rest.pop("tokenizer"), **rest)
