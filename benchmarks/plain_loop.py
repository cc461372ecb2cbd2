"""The library's own overhead: train.py's step time against the shortest hand-written loop.

    python benchmarks/plain_loop.py [--steps 40] [--warmup 10] [--rounds 2] [--json] \\
        [train.py arguments, default: the debug model config]

In one process, alternating ``--rounds`` times: (1) the library: ``train.main`` (config system,
data loader, metrics, checkpoint manager, hooks) for ``--steps`` steps, step times from the wall
times of its TensorBoard events at every ``metrics.log_freq`` step after ``--warmup``; (2) the
plain loop below: the same model class, batch shape, initialization, AdamW settings and gradient
clipping, on batches of random tokens made beforehand, timed with ``time.perf_counter`` over the
same steps. The ratio library / plain is printed (1.00 = no overhead); the aim is <= 1.05.
One process, so use it on CPU or one GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    a, train_args = parser.parse_known_args()
    train_args = train_args or ["--job.config_file", "train_configs/debug_model.toml"]

    import train
    from torchtitan.config.parse import parse_args

    job_config = parse_args(train_args)
    log_freq = job_config.metrics.log_freq
    if a.warmup % log_freq or a.steps % log_freq or a.steps - a.warmup < log_freq:
        parser.error(
            f"--warmup {a.warmup} and --steps {a.steps} must be multiples of metrics.log_freq "
            f"({log_freq}), with at least one interval between them"
        )
    library, plain = [], []
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory(prefix="plain-loop-") as dump:
            args = [
                *train_args,
                "--training.steps",
                str(a.steps),
                "--metrics.enable_tensorboard",
                "true",
                "--checkpoint.enable",
                "false",
                "--job.dump_folder",
                dump,
            ]
            if train.main(args) != 0:
                return 1
            library.append(_library_step_time(dump, a.warmup, a.steps))
        plain.append(plain_step_time(parse_args(args), a.warmup, a.steps))
        print(f"round {r + 1}: library {library[-1]:.4f}s  plain {plain[-1]:.4f}s", file=sys.stderr)
    result = {
        "steps_measured": a.steps - a.warmup,
        "library_step_s": statistics.median(library),
        "plain_step_s": statistics.median(plain),
        "library_rounds_s": library,
        "plain_rounds_s": plain,
    }
    result["ratio"] = result["library_step_s"] / result["plain_step_s"]
    if a.json:
        print(json.dumps(result))
    else:
        print(
            f"step time over steps {a.warmup + 1}-{a.steps}, median of {a.rounds} rounds\n"
            f"  library (train.py)  {result['library_step_s']:.4f} s\n"
            f"  plain loop          {result['plain_step_s']:.4f} s\n"
            f"  ratio               {result['ratio']:.3f}  (aim: <= 1.05)"
        )
    return 0


def _library_step_time(dump: str, warmup: int, steps: int) -> float:
    from torchtitan.observability.tb_events import read_events

    times = read_events(dump, "loss")
    return (times[steps][0] - times[warmup][0]) / (steps - warmup)


def plain_step_time(job_config, warmup: int, steps: int) -> float:
    """Seconds per step of the shortest loop training the same model on the same shapes."""
    import torch
    import torch.nn.functional as F

    from torchtitan.data.tokenizer import build_tokenizer, tokenizer_source
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.spec import get_model_args, get_model_spec

    t, o = job_config.training, job_config.optimizer
    device = dist_utils.init_device()
    path, key = tokenizer_source(job_config.model)
    vocab = build_tokenizer(path, key=key).n_words
    args = get_model_args(job_config.model.name, job_config.model.flavor)
    args = dataclasses.replace(args, vocab_size=vocab, max_seq_len=t.seq_len)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = get_model_spec(job_config.model.name).cls(args)  # the family's own model class
    model.to_empty(device=device)
    model.init_weights()
    fused = o.implementation == "fused"
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=fused,
        foreach=not fused,
    )
    # as train.py on one GPU: bfloat16 autocast (training.mixed_precision_param); float32 on CPU
    bf16 = device.type == "cuda" and t.mixed_precision_param == "bfloat16"
    batches = torch.randint(0, vocab, (steps, t.local_batch_size, t.seq_len + 1), device=device)
    loss = torch.zeros(())
    for step in range(steps):
        if step == warmup:
            loss.item()  # waits for the device
            start = time.perf_counter()
        x, y = batches[step, :, :-1], batches[step, :, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss.item()  # waits for the device
    return (time.perf_counter() - start) / (steps - warmup)


if __name__ == "__main__":
    sys.exit(main())
