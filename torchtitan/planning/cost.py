"""The cost model: one training step's time for a layout, term by term.

Every term is a count (FLOPs, bytes) from the model's description divided by a rate of the
hardware (:class:`Hardware`: the GPU table's datasheet figures, scaled by measured efficiencies).
The step time is the compute plus what the code does not overlap with it:

- **compute**: the matmul FLOPs (``6 N`` per token) at ``peak x matmul_efficiency``, the
  attention FLOPs at ``peak x attention_efficiency``, and the elementwise traffic (norms, rotary
  embedding, SwiGLU, residual adds, the loss's softmax over the vocabulary) at the HBM bandwidth.
  Activation checkpointing recomputes the blocks' forward: full adds 1/3 of their FLOPs,
  per-op selective about 1/6 (half the matmuls are recomputed), every k-th layer 1/(3k).
  A pipeline rank computes its own stages: the last one holds the output and the loss.
- **FSDP** (over ``dp_shard x cp``): per local batch the blocks' parameters are gathered in the
  forward and again in the backward (bf16) and their gradients reduce-scattered (in
  ``training.mixed_precision_reduce``), each ``(f-1)/f`` of the bytes per rank. FSDP2 prefetches
  the next block while this one computes, so only what exceeds the compute is exposed, and at
  least one block's worth (the first gather, the last reduce-scatter).
- **HSDP / DDP** (``dp_replicate``): the gradients' all-reduce (``2 (r-1)/r`` of the bytes)
  after every backward (gradient accumulation does not skip it), overlapped with that backward.
- **TP** (with sequence parallel): per block and direction two all-gathers and two
  reduce-scatters of the activations (``(t-1)/t`` of ``batch x seq x dim`` bf16 each); full
  checkpointing repeats the forward's. Not overlapped (asynchronous TP is off by default).
- **CP** (ring attention): per block the keys and values go round the ring (``cp - 1`` hops of
  this rank's K and V, its TP rank's heads), and their gradients in the backward; overlapped
  with the attention's compute.
- **EP**: per MoE block, dispatch and combine in each direction (all-to-all of ``tokens x top_k
  x dim`` bf16, ``(e-1)/e`` of it leaving the rank). Not overlapped. With whole experts under
  TP (``expert_tensor_parallel_degree`` 1, EP borrowing the TP ranks too), each TP rank sends
  its ``1/tp`` of the rows.
- **PP**: the bubble, ``(p-1) / (v m)`` of the pipeline's compute for ``m`` micro-batches and
  ``v`` stages per rank (1F1B, GPipe: v = 1; Interleaved1F1B: v = 2; ZBVZeroBubble: a third of
  that, Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ZB-H1), plus each micro-batch's
  activations sent forward and their gradients back.
- **optimizer**: AdamW reads parameter, gradient and two moments and writes three (28 bytes per
  local float32 parameter, 20 with bfloat16 moments) at the HBM bandwidth.

A mixture-of-experts block's routed experts are split over EP (``E / ep`` per rank) and sharded
by FSDP over the ``dp_shard x cp / ep`` ranks left (``dp_shard x cp x tp / ep`` with whole
experts, which FSDP then gathers whole): EP shrinks what FSDP gathers.

Each collective is ``latency + bytes / bandwidth`` over the link its group uses: the GPU link
inside a node when the group's ranks fit in one (the mesh's innermost dimension is TP, then CP,
dp_shard, dp_replicate, PP), else the network per GPU. Where it is known to be wrong:
docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.devices import Device
from torchtitan.distributed.pipeline import stages_per_rank
from torchtitan.train.memory_fit import RESERVE_GIB

# the elementwise traffic per token per block, in elements, forward and backward together:
# two RMSNorms (read and write dim each), rotary embedding of q and k (read and write), two
# residual adds (read two, write one), SwiGLU's silu x mul (read two hidden, write one), and the
# backward about twice the forward
NORM_ROPE_ADD = 3 * (4 + 2 + 6)  # x dim (rope's k side counted at dim: an upper bound)
SWIGLU = 3 * 3  # x hidden
# the loss per token: the logits written in bf16, read and upcast, softmax and its gradient in
# float32 (about 16 bytes per vocabulary entry)
LOSS_BYTES = 16


@dataclass(frozen=True)
class Hardware:
    """The rates the cost model divides by, per device."""

    name: str
    peak_flops: float  # dense FLOP/s in the compute dtype
    matmul_efficiency: float  # measured fraction of the peak a large matmul reaches
    attention_efficiency: float  # fraction of the peak the attention kernel reaches
    hbm_bytes_s: float
    link_bytes_s: float  # inside a node, each direction
    network_bytes_s: float  # across nodes, per device
    devices_per_node: int
    latency_s: float  # per collective
    memory_gib: float
    source: str  # where the figures come from, for the output
    compute_bytes: int = 2  # bytes per element of the compute dtype: bf16, float32 on CPU
    # collectives run beside the compute (GPU: NCCL's kernels and copy engines); on CPU the
    # same cores do both, so nothing is hidden
    overlap: bool = True
    # more processes than cores (CPU): a rank waiting in the pipeline's bubble lends its core to
    # another, so the bubble costs the machine nothing
    idle_lends_cores: bool = False
    # memory: kept free on each device (GPU: the CUDA context, NCCL's buffers, the allocator's
    # slack), and held by a process beside the traced step (CPU: its resident set holds the
    # tokenizer, the data loader's rows and buffers, the process groups)
    reserve_gib: float = RESERVE_GIB
    runtime_gib: float = 0.0


def gpu_hardware(
    device: Device,
    devices_per_node: int = 8,
    matmul_efficiency: float | None = None,
    attention_efficiency: float | None = None,
    network_gb_s: float | None = None,
    memory_gib: float | None = None,
) -> Hardware:
    """A GPU of the table, with its measured efficiencies where the project has them."""
    measured = device.matmul_efficiency is not None
    return Hardware(
        name=device.key,
        peak_flops=device.bf16_tflops * 1e12,
        matmul_efficiency=matmul_efficiency or device.matmul_efficiency or DEFAULT_MATMUL,
        attention_efficiency=attention_efficiency or DEFAULT_ATTENTION,
        hbm_bytes_s=device.hbm_gb_s * 1e9,
        link_bytes_s=device.link_gb_s * 1e9,
        network_bytes_s=(network_gb_s or device.network_gb_s) * 1e9,
        devices_per_node=devices_per_node,
        latency_s=GPU_LATENCY_S,
        memory_gib=memory_gib or device.memory_gib,
        source=f"{device.key}: datasheet rates, matmul efficiency "
        + ("measured (docs/performance.md)" if measured else "assumed (not measured here)"),
    )


# the matmul ceiling of the two GPUs measured (H100 782/989, H200 759/989: docs/performance.md),
# their mean, for a GPU not measured
DEFAULT_MATMUL = 0.78
# fitted to one measured run: Llama 3.2 1B, seq 8192, batch 2, compiled, SDPA flash attention,
# 58,790 tokens/s on one H100 (docs/performance.md); the same constants predict its seq-2048 run
# (72,548 measured) within 3% (docs/planning.md: calibration)
DEFAULT_ATTENTION = 0.34
GPU_LATENCY_S = 20e-6  # a small NCCL collective inside a node


@dataclass(frozen=True)
class ModelFacts:
    """What the cost model reads of a model: counts from its description (meta device)."""

    name: str
    parameters: int  # every parameter once
    flops_per_token: float  # training FLOPs per token at seq_len (the MFU numerator)
    attention_flops_per_token: float  # the part of it in attention's score and value products
    n_layers: int
    dim: int
    hidden_dim: int  # the dense SwiGLU width (the experts' for MoE blocks)
    vocab_size: int
    kv_width: int  # n_kv_heads x head_dim
    layer_parameters: int  # the blocks' parameters (all of them)
    outer_parameters: int  # embedding, final norm, output
    output_flops_per_token: float  # the output projection's training FLOPs per token
    moe_layers: int = 0
    top_k: int = 0
    expert_parameters: int = 0  # the routed experts' (every MoE block's), in layer_parameters


@dataclass(frozen=True)
class Layout:
    """One way to run the job: the degrees, activation checkpointing and the batch's cut."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int = 1
    etp: int = 1  # the routed experts' TP degree under EP: 1 (whole experts) or tp
    ac: str = "none"  # none | selective (per-op policy) | selective:k (every k-th layer) | full
    local_batch: int = 1  # sequences per data-parallel rank per forward
    accum: int = 1  # gradient accumulation steps
    schedule: str | None = None  # the pipeline schedule, pp > 1
    microbatch: int = 1  # sequences per pipeline micro-batch

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def experts_whole(self) -> bool:
        """EP borrowing the TP ranks too (``etp`` 1 under TP): whole experts on each EP rank,
        the TP ranks splitting the routed rows."""
        return self.tp > 1 and self.ep > 1 and self.etp == 1

    @property
    def microbatches(self) -> int:
        return self.local_batch // self.microbatch if self.pp > 1 else 1

    def describe(self) -> str:
        parts = [
            f"{name} {n}"
            for name, n in (
                ("dp_replicate", self.dp_replicate),
                ("fsdp", self.dp_shard),
                ("tp", self.tp),
                ("cp", self.cp),
                ("pp", self.pp),
                ("ep", self.ep),
            )
            if n > 1
        ] or ["one device"]
        if self.tp > 1 and self.ep > 1:
            parts.append("whole experts" if self.experts_whole else "experts split over tp")
        if self.pp > 1:
            parts.append(f"{self.schedule} {self.microbatches}x{self.microbatch}")
        batch = f"batch {self.local_batch}" + (f" x{self.accum} accum" if self.accum > 1 else "")
        return f"{', '.join(parts)}; AC {self.ac}; {batch}"


@dataclass
class StepCost:
    seconds: float
    terms: dict[str, float] = field(default_factory=dict)  # exposed seconds per term

    @property
    def limit(self) -> str:
        """The largest term, the one to attack."""
        return max(self.terms, key=self.terms.get)


AC_RECOMPUTE = {"none": 0.0, "selective": 1 / 6, "full": 1 / 3}
BUBBLE_SCALE = {"ZBVZeroBubble": 1 / 3}


def step_cost(
    m: ModelFacts,
    lay: Layout,
    hw: Hardware,
    seq_len: int,
    reduce_bytes: int = 4,
    state_bytes: int = 4,
) -> StepCost:
    """The predicted time of one optimizer step of ``lay`` (its global batch:
    ``local_batch x accum x dp_replicate x dp_shard`` sequences of ``seq_len``)."""
    t, b = {}, hw.compute_bytes
    tokens = lay.local_batch * seq_len // lay.cp  # one rank's tokens per forward (pre-TP split)
    steps = lay.accum  # forwards per optimizer step
    layers = m.n_layers / lay.pp  # per pipeline rank
    mode, _, interval = lay.ac.partition(":")
    recompute = 1 / (3 * int(interval)) if interval else AC_RECOMPUTE[mode]
    # compute per forward+backward of one local batch on this rank (the last pipeline stage's:
    # it holds the output and the loss)
    block_matmul = (
        m.flops_per_token - m.attention_flops_per_token - m.output_flops_per_token
    ) / m.n_layers
    block_attention = m.attention_flops_per_token / m.n_layers
    per_token = (
        layers * (1 + recompute) * block_matmul / hw.matmul_efficiency
        + layers * (1 + recompute) * block_attention / hw.attention_efficiency
        + m.output_flops_per_token / hw.matmul_efficiency
    ) / hw.peak_flops
    traffic = layers * (1 + recompute) * (NORM_ROPE_ADD * m.dim + SWIGLU * m.hidden_dim) * b
    traffic += m.vocab_size * LOSS_BYTES
    per_token += traffic / hw.hbm_bytes_s
    compute = steps * tokens / lay.tp * per_token
    t["compute"] = compute
    local_params, per_pass = _fsdp(m, lay, hw, 2 * b + reduce_bytes)
    if per_pass > 0:
        fsdp = steps * (per_pass + 3 * layers * hw.latency_s)
        t["fsdp"] = max(fsdp - compute, fsdp / max(layers, 1)) if hw.overlap else fsdp
    if lay.dp_replicate > 1:  # every backward all-reduces (no skipped syncs when accumulating)
        r = lay.dp_replicate
        grads = reduce_bytes * local_params
        stride = lay.tp * lay.dp_shard * lay.cp
        ar = _collective(hw, r, stride, 2 * grads * (r - 1) / r) + layers * hw.latency_s
        hidden = ar - compute / steps * 2 / 3  # behind its backward
        t["replicate"] = steps * (max(hidden, ar / max(layers, 1)) if hw.overlap else ar)
    if lay.tp > 1:
        act = tokens * m.dim * b * (lay.tp - 1) / lay.tp
        per_block = (8 + (4 if lay.ac == "full" else 0)) * act
        t["tp"] = steps * layers * (_collective(hw, lay.tp, 1, per_block) + 8 * hw.latency_s)
    if lay.cp > 1:
        kv = 2 * tokens * m.kv_width / lay.tp * b  # TP splits the heads
        ring = 3 * (lay.cp - 1) * kv  # forward K, V; backward K, V and their gradients
        ring_s = _collective(hw, lay.cp, lay.tp, ring) + 3 * (lay.cp - 1) * hw.latency_s
        attention_s = tokens / lay.tp * block_attention / (hw.peak_flops * hw.attention_efficiency)
        t["cp"] = steps * layers * (max(0.0, ring_s - attention_s) if hw.overlap else ring_s)
    if lay.ep > 1 and m.moe_layers:
        moe_layers = m.moe_layers / lay.pp
        # whole experts: each TP rank sends its share of the routed rows, to EP ranks inside
        # its TP group first (the TP ranks are the innermost the EP group borrows)
        rows = tokens / (lay.tp if lay.experts_whole else 1)
        a2a = 4 * rows * m.top_k * m.dim * b * (lay.ep - 1) / lay.ep
        stride = 1 if lay.experts_whole else lay.tp
        t["ep"] = steps * moe_layers * (_collective(hw, lay.ep, stride, a2a) + 4 * hw.latency_s)
    if lay.pp > 1:
        v = stages_per_rank(lay.schedule or "1F1B") or 2  # a looped one's default cut: two
        bubble = (lay.pp - 1) / (v * lay.microbatches) * BUBBLE_SCALE.get(lay.schedule, 1.0)
        t["pp_bubble"] = 0.0 if hw.idle_lends_cores else bubble * compute
        hop = lay.microbatch * seq_len // lay.cp * m.dim * b / lay.tp
        # pp is the outermost dimension: neighbouring stages are world / pp ranks apart
        send = _collective(hw, 2, lay.world // lay.pp, hop) + hw.latency_s
        t["pp_send"] = steps * lay.microbatches * 2 * v * send
    adamw = 12 + 4 * state_bytes  # read p and g, write p; read and write two moments
    t["optimizer"] = adamw * local_params / hw.hbm_bytes_s
    return StepCost(sum(t.values()), t)


def _fsdp(m: ModelFacts, lay: Layout, hw: Hardware, per_byte: int) -> tuple[float, float]:
    """A rank's parameters, and the seconds of FSDP's collectives per forward and backward
    (``per_byte``: bytes moved per gathered parameter, gathered twice and reduced once). FSDP
    shards over dp_shard x cp; the routed experts: E / ep of them on a rank (EP borrows its
    ranks from dp_shard x cp, and from tp with whole experts), FSDP over the rest of those
    ranks (the experts' mesh: efsdp, ep, then tp when they are split over it)."""
    whole = lay.experts_whole
    f = lay.dp_shard * lay.cp
    ef = max(1, f * (lay.tp if whole else 1) // lay.ep)
    experts = m.expert_parameters / lay.pp / lay.ep / (1 if whole else lay.tp)
    dense = ((m.layer_parameters - m.expert_parameters) / lay.pp + m.outer_parameters) / lay.tp
    per_pass = _collective(hw, f, lay.tp, per_byte * dense * (f - 1) / f)
    expert_stride = lay.ep * (1 if whole else lay.tp)
    per_pass += _collective(hw, ef, expert_stride, per_byte * experts * (ef - 1) / ef)
    return dense / f + experts / ef, per_pass


def _link(hw: Hardware, span: int) -> float:
    """The bandwidth of a group whose ranks span ``span`` consecutive ranks."""
    return hw.link_bytes_s if span <= hw.devices_per_node else hw.network_bytes_s


def _collective(hw: Hardware, size: int, stride: int, bytes_per_rank: float) -> float:
    """Seconds to move ``bytes_per_rank`` for a group of ``size`` ranks ``stride`` apart."""
    return bytes_per_rank / _link(hw, size * stride)


def tokens_per_second_per_device(m: ModelFacts, lay: Layout, cost: StepCost, seq_len: int) -> float:
    tokens = lay.local_batch * lay.accum * lay.dp_replicate * lay.dp_shard * seq_len
    return tokens / cost.seconds / lay.world


def mfu(m: ModelFacts, lay: Layout, cost: StepCost, hw: Hardware, seq_len: int) -> float:
    return m.flops_per_token * tokens_per_second_per_device(m, lay, cost, seq_len) / hw.peak_flops
