"""Downstream accuracy every ``eval.freq`` steps: multiple-choice tasks scored as lm-eval scores
them, under any parallel layout.

The tasks are read and tokenized once, at start-up (a malformed file stops the run there, in one
line). Each evaluation scores every request, a context with one of its choices, as one row
(``torchtitan/evaluation/scoring.py``); request ``i`` goes to data-parallel rank ``i % dp``, every
rank runs the same number of batches (the last padded with empty rows), and the rows go through
the model as training's batches do (the sequence split under context parallel, the vocab-parallel
loss under TP, the pipeline schedule forward-only under PP: ``StepRunner.forward_row_loss``). One
all-gather over the data-parallel ranks gives every rank every log-likelihood; rank 0 logs each
task's ``acc`` and ``acc_norm`` and writes each document's log-likelihoods to
``job.dump_folder/eval/step-N/TASK.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.config.schema import JobConfig
from torchtitan.evaluation.scoring import choice_scores, encode_pair, request_rows
from torchtitan.evaluation.tasks import Doc, TaskSpec, parse_tasks, read_task
from torchtitan.observability.log import logger
from torchtitan.train.step import StepRunner


@dataclass(frozen=True)
class TaskResult:
    """One task's scores at one evaluation: each of its metrics' mean over its documents."""

    name: str
    docs: int
    scores: dict[str, float]


class DownstreamEvaluator:
    """Scores ``eval.tasks`` through the step runner, forward only."""

    def __init__(self, job_config: JobConfig, *, runner: StepRunner, tokenizer: Any) -> None:
        e, t = job_config.eval, job_config.training
        self.job_config, self.cfg, self.runner = job_config, e, runner
        self.rows = e.local_batch_size or t.local_batch_size
        self.dims, self.device = runner.dims, runner.device
        self.tasks: list[tuple[TaskSpec, list[Doc]]] = [
            (spec, read_task(spec)) for spec in parse_tasks(e.tasks)
        ]
        self.pad_id = max(tokenizer.eos_id, 0)
        # every request of every task, in order: (context ids, continuation ids)
        self.pairs = [
            encode_pair(tokenizer, ctx, cont, e.add_bos)
            for _, docs in self.tasks
            for doc in docs
            for ctx, cont in doc.requests
        ]
        self.seq_len = e.seq_len or self._row_length(t.seq_len)
        cut = sum(len(ctx) + len(cont) - 1 > self.seq_len for ctx, cont in self.pairs)
        if cut:  # lm-eval keeps a request's end the same way (HFLM's left truncation)
            logger.warning(
                f"eval: {cut} of {len(self.pairs)} requests are longer than the rows "
                f"({self.seq_len} tokens): their contexts lose their beginning"
            )
        n_docs = sum(len(docs) for _, docs in self.tasks)
        logger.info(
            f"Downstream evaluation: {len(self.tasks)} task(s), {n_docs} documents, "
            f"{len(self.pairs)} requests, every {e.freq} steps"
        )

    def _row_length(self, training_seq_len: int) -> int:
        """The rows' length when ``eval.seq_len`` is 0: the training shape under pipeline or
        context parallel (which fix it), else the longest request's, in multiples of 64 and of
        the tensor-parallel degree (the sequence-parallel split), at most training's."""
        if self.dims.pp > 1 or self.dims.cp > 1:
            return training_seq_len
        longest = max(len(ctx) + len(cont) - 1 for ctx, cont in self.pairs)
        step = math.lcm(64, self.dims.tp)
        return min(training_seq_len, -(-longest // step) * step)

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0 or step == self.job_config.training.steps

    def run(self, step: int) -> tuple[list[TaskResult], float]:
        """Every task's scores at ``step`` (on every rank), and the seconds it took."""
        t0 = time.perf_counter()
        parts = self.runner.parts
        modes = [p.training for p in parts]
        for p in parts:
            p.eval()
        try:
            lls = self._loglikelihoods()
        finally:
            for p, mode in zip(parts, modes):
                p.train(mode)
        results, start = [], 0
        for spec, docs in self.tasks:
            samples = []
            for doc in docs:
                doc_lls = lls[start : start + len(doc.requests)]
                start += len(doc.requests)
                samples.append({"doc": doc.index, "gold": doc.gold, "lls": doc_lls})
                samples[-1].update(choice_scores(doc, doc_lls))
            results.append(_result(spec, samples))
            if self.cfg.save_samples and self._rank0:
                self._write_samples(step, spec.name, samples)
        return results, time.perf_counter() - t0

    @property
    def _rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def _loglikelihoods(self) -> list[float]:
        """Every request's log-likelihood, in order (each data-parallel rank scores its share)."""
        dp, rank = self.dims.dp, self.dims.dp_rank
        mine = self.pairs[rank::dp]
        n_batches = math.ceil(math.ceil(len(self.pairs) / dp) / self.rows)
        local = []
        for b in range(n_batches):
            chunk = mine[b * self.rows : (b + 1) * self.rows]
            chunk += [([], [])] * (self.rows - len(chunk))  # empty rows: nothing scored
            local.append(
                -self.runner.forward_row_loss(request_rows(chunk, self.seq_len, self.pad_id))
            )
        scores = torch.cat(local).to(self.device)
        dp_mesh = self.dims.dp_mesh
        if dp_mesh is not None and dp_mesh.size() > 1:
            gathered = [torch.empty_like(scores) for _ in range(dp)]
            dist.all_gather(gathered, scores, group=dp_mesh.get_group())
            scores = torch.stack(gathered, dim=1)  # [slot, rank]: request slot * dp + rank
        return scores.flatten()[: len(self.pairs)].tolist()

    def _write_samples(self, step: int, task: str, samples: list[dict]) -> None:
        folder = os.path.join(self.job_config.job.dump_folder, "eval", f"step-{step}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{task}.jsonl"), "w", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps(sample) + "\n")


def _result(spec: TaskSpec, samples: list[dict]) -> TaskResult:
    n = len(samples)
    scores = {m: sum(s[m] for s in samples) / n for m in spec.layout.metrics}
    return TaskResult(spec.name, n, scores)
