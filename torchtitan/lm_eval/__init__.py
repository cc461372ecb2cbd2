"""EleutherAI's lm-evaluation-harness on this library's checkpoints: the ``torchtitan`` model.

``TorchTitanLM`` serves lm-eval's three request kinds from a DCP ``step-N`` folder or a Hugging
Face model folder, for every registered family (the whole model on one device):

* ``loglikelihood``: lm-eval's encoding (``TemplateLM``: the context's trailing space moved, the
  continuation's tokens split off the whole text's), each request's last ``max_length + 1``
  tokens, the summed log-probability of the continuation and whether each of its tokens is the
  most likely one, as its ``hf`` model computes them;
* ``loglikelihood_rolling``: the text in lm-eval's disjoint rolling windows of ``max_length``;
* ``generate_until``: greedy decoding until a stop string, EOS or ``max_gen_toks`` tokens.

From Python::

    import lm_eval
    from torchtitan.lm_eval import TorchTitanLM
    lm = TorchTitanLM(checkpoint="outputs/checkpoint/step-1000", flavor="debugmodel",
                      tokenizer="tests/assets/tokenizer/tiktoken.model")
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

From lm-eval's command line (every option it takes), with the model registered::

    python -m torchtitan.lm_eval --model torchtitan \\
        --model_args checkpoint=DIR,model=llama3,flavor=debugmodel,tokenizer=PATH --tasks hellaswag

``model_args``: ``checkpoint`` (required), ``model`` (a DCP folder's family, default llama3;
a Hugging Face folder names its own), ``flavor`` (a DCP folder's), ``tokenizer`` (default: the
folder's), ``max_length`` (default: the model's ``max_seq_len``), ``add_bos_token`` (default
true: contexts start with BOS, as training's documents), ``dtype`` (float32), ``device``,
``batch_size`` (lm-eval's ``--batch_size`` too), ``max_gen_toks`` (256).
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import lm_eval  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "torchtitan.lm_eval needs lm-evaluation-harness: pip install 'lm-eval>=0.4.9'"
    ) from e

from torchtitan.errors import ConfigError
from torchtitan.evaluation.inference import load_model, load_tokenizer
from torchtitan.evaluation.scoring import request_rows
from torchtitan.observability.log import logger

__all__ = ["TorchTitanLM", "cli"]

# what lm-eval adds to model_args itself (its --batch_size, --max_batch_size, --device)
_LM_EVAL_KEYS = {"max_batch_size"}


@register_model("torchtitan")
class TorchTitanLM(TemplateLM):
    """lm-eval's model for a checkpoint of this library (see the module docstring)."""

    def __init__(
        self,
        checkpoint: str,
        model: str = "llama3",
        flavor: str | None = None,
        tokenizer: str | None = None,
        max_length: int | None = None,
        add_bos_token: bool = True,
        dtype: str = "float32",
        device: str | None = None,
        batch_size: int | str = 8,
        max_gen_toks: int = 256,
        **others: Any,
    ) -> None:
        super().__init__()
        unknown = sorted(set(others) - _LM_EVAL_KEYS)
        if unknown:
            raise ConfigError(
                f"model_args: unknown key(s) {unknown}; valid: checkpoint, model, flavor, "
                "tokenizer, max_length, add_bos_token, dtype, device, batch_size, max_gen_toks"
            )
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ConfigError(f"model_args dtype: {dtype!r} is not a torch dtype (e.g. float32)")
        net, args = load_model(
            str(checkpoint), model, flavor, key="checkpoint", flavor_key="flavor"
        )
        device = str(device or "cuda")
        if device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's command line asks for cuda unless told otherwise, as its hf model does
            logger.warning(f"device {device!r}: no CUDA device here, evaluating on the CPU")
            device = "cpu"
        self._device = torch.device(device)
        self.net = net.to(self._device, getattr(torch, dtype))
        self.tokenizer = load_tokenizer(
            tokenizer, str(checkpoint), key="tokenizer", checkpoint_key="checkpoint"
        )
        self.max_length = int(max_length or args.max_seq_len)
        if self.max_length > args.max_seq_len:
            raise ConfigError(
                f"model_args max_length: {self.max_length} is longer than the model's rotary "
                f"table ({args.max_seq_len}); use at most that"
            )
        self.add_bos = bool(add_bos_token)
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self._special_ids = _special_ids(self.tokenizer)
        self._prefix_text = self.tok_decode([self.prefix_token_id], skip_special_tokens=False)

    # ---- what TemplateLM asks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_id
        return bos if bos is not None and bos >= 0 else self.tokenizer.eos_id

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and string.startswith(self._prefix_text):
            bos = False  # the text starts with BOS already (HFLM's check)
        return self.tokenizer.encode(string, bos=bos, eos=False)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``tokens``, special tokens left out by default (as HFLM decodes)."""
        if skip_special_tokens:
            tokens = [t for t in tokens if t not in self._special_ids]
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Each request's ``(summed log-probability of the continuation, whether it is the
        greedy one)``, in batches of similar length (longest first), in request order."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            pairs = [(requests[i][1], requests[i][2]) for i in chunk]
            length = min(self.max_length, max(len(c) + len(x) for c, x in pairs) - 1)
            for i, result in zip(chunk, self._score(pairs, length)):
                out[i] = result
                if requests[i][0] is not None:  # not a rolling window
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], result)
        return out

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]], length: int) -> list:
        rows = request_rows(pairs, length, pad_id=max(self.tokenizer.eos_id, 0))
        logits = self.net(rows.inputs.to(self._device)).float()
        labels = rows.labels.to(self._device)
        valid = labels >= 0
        logprobs = torch.log_softmax(logits, dim=-1)
        picked = logprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        lls = (picked * valid).sum(1)
        greedy = ((logits.argmax(-1) == labels) | ~valid).all(1)
        return [(float(ll), bool(g)) for ll, g in zip(lls.tolist(), greedy.tolist())]

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over lm-eval's disjoint rolling windows."""
        results = []
        for (text,) in [req.args for req in requests]:
            windows = [
                (None, *make_disjoint_window(w))
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    @torch.no_grad()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy text after each context, as HFLM generates it: lm-eval's own reading of the
        generation settings (``max_gen_toks`` and its aliases, ``until`` plus the EOS text),
        the context cut to its last ``max_length - max_gen_toks`` tokens, the text cut at the
        first stop string."""
        results = []
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for context, gen_kwargs in [req.args for req in requests]:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ConfigError(
                    "torchtitan lm-eval model: generation is greedy only, and this task samples "
                    f"({kwargs}); use a greedy task config, or the hf model on an export"
                )
            until = [u for u in handle_stop_sequences(kwargs.get("until"), eos=eos) if u]
            budget = int(kwargs["max_gen_toks"])
            if budget >= self.max_length:
                raise ConfigError(
                    f"max_gen_toks {budget} must be below the model's max_length "
                    f"{self.max_length} (model_args max_length)"
                )
            ids = self.tok_encode(context)[-(self.max_length - budget) :]
            text = self._greedy(ids, until, budget)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
        return results

    def _greedy(self, ids: list[int], until: list[str], budget: int) -> str:
        """Up to ``budget`` greedy tokens, stopping at EOS or once the text (special tokens
        kept) holds a stop string; their text without special tokens, cut at the first stop."""
        new: list[int] = []
        for _ in range(budget):
            logits = self.net(torch.tensor([ids + new], device=self._device))[0, -1]
            new.append(int(logits.argmax()))
            raw = self.tok_decode(new, skip_special_tokens=False)
            if new[-1] == self.eot_token_id or any(stop in raw for stop in until):
                break
        text = self.tok_decode(new)
        for stop in until:
            text = text.split(stop)[0]
        return text


def _special_ids(tok: Any) -> set[int]:
    """The tokenizer's special tokens: BOS, EOS, pad, and the ones it declares."""
    ids = {i for i in (tok.bos_id, tok.eos_id, tok.pad_id) if i is not None and i >= 0}
    ids |= set(getattr(tok, "special_tokens", {}).values())  # tiktoken's
    added = getattr(getattr(tok, "_model", None), "get_added_tokens_decoder", None)
    if callable(added):  # a tokenizer.json's
        ids |= {i for i, t in added().items() if getattr(t, "special", False)}
    return ids


def cli() -> None:
    """lm-eval's command line, with ``--model torchtitan`` registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
