"""What a LoRA run exports: the adapters merged into the weights (an ordinary Hugging Face folder),
and the adapters alone as a ``peft`` adapter folder that ``PeftModel.from_pretrained`` loads onto
the base model.

A ``peft`` adapter folder is ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` with, for each adapted module of the
``transformers`` model, ``base_model.model.<module>.lora_A.weight [r, in]`` and
``.lora_B.weight [out, r]`` (``peft`` scales by ``lora_alpha / r``, as here).

A layer of ours may be several ``transformers`` modules (the fused ``wqkv`` is ``q_proj``,
``k_proj`` and ``v_proj``). The family's state-dict adapter maps its weight to theirs by rows
(splitting, permuting within heads); ``B`` has the weight's rows, so the same mapping gives each
module's ``B``, and each gets the same ``A``: ``B_q A x`` is exactly the ``q_proj`` rows of
``B A x``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

LORA_A, LORA_B = ".lora_a", ".lora_b"
PEFT_PREFIX = "base_model.model."
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def adapted_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """The names of the adapted modules in a (full) state dict."""
    return sorted(k[: -len(LORA_A)] for k in state if k.endswith(LORA_A))


@dataclass(frozen=True)
class LoRAExport:
    """The settings an export needs (``[lora]``), and where the base model came from."""

    rank: int
    alpha: float
    dropout: float
    merge: bool = True
    base_model: str | None = None
    config_file = PEFT_CONFIG  # written last: an adapter folder with it is whole

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def merged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (full tensors) with each adapter folded into its weight, ``W + (alpha / r)
        B A`` computed in float32, and the adapters left out."""
        out = {k: v for k, v in state.items() if not k.endswith((LORA_A, LORA_B))}
        for m in adapted_modules(state):
            w = state[f"{m}.weight"]
            delta = state[m + LORA_B].float() @ state[m + LORA_A].float()
            out[f"{m}.weight"] = (w.float() + self.scale * delta).to(w.dtype)
        return out

    def peft_tensors(
        self, state: dict[str, torch.Tensor], hf_adapter: Any
    ) -> dict[str, torch.Tensor]:
        """The adapters of ``state`` under ``peft``'s names for the ``transformers`` model
        (``hf_adapter``: the family's state-dict adapter, whose ``to_hf`` maps our weights)."""
        out: dict[str, torch.Tensor] = {}
        for m in adapted_modules(state):
            a = state[m + LORA_A]
            for hf_name, b in hf_adapter.to_hf({f"{m}.weight": state[m + LORA_B]}).items():
                module = PEFT_PREFIX + hf_name.removesuffix(".weight")
                out[f"{module}.lora_A.weight"] = a.clone().contiguous()
                out[f"{module}.lora_B.weight"] = b.contiguous()
        return out

    def peft_config(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``adapter_config.json`` of these adapters (``target_modules``: the adapted modules'
        full names, so that ``peft`` adds adapters to those only, whatever subset of the
        layers they are)."""
        targets = sorted(
            k.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            for k in tensors
            if k.endswith(".lora_A.weight")
        )
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": targets,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "modules_to_save": None,
            "init_lora_weights": True,
            "inference_mode": True,
        }

    def write_peft(self, folder: str, tensors: dict[str, torch.Tensor]) -> None:
        """``folder`` as a ``peft`` adapter folder of ``tensors`` (``peft_tensors``)."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, PEFT_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(folder, PEFT_CONFIG), "w") as f:
            json.dump(self.peft_config(tensors), f, indent=2)
