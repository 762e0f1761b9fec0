"""Whole training steps of one model, timed two ways: the bare model step and the trainer's.

Issue 42 measures the project against torchtitan and its own trainer against the bare model:
tools/bench_trainer_overhead.py, tools/profile_step.py and tools/bench_peer.py share what is
here.

Design choices:
- The model is built by the trainer's own path (`training/build.build_trainer` for the
  trainer, `models/build.build_model` for the bare step), from one raw run config, seeded
  alike, so both start from the same weights and see the same batch.
- The bare step is what a user would write by hand around the same GPTModel: forward with
  labels, token-mean cross-entropy, backward, clip 1.0, torch AdamW (foreach), zero grads.
  Against the trainer it runs the trainer's AdamW instead (`adam_impl`; by default torch's
  default, the one Megatron-Core builds: on CPU the per-tensor loop, bit-identical to
  foreach (tests/training/test_step_bench_adam.py) and faster there, foreach on CPU being a
  loop of the same kernels plus its list overhead), so the overhead measured is the
  trainer's machinery, not a slower optimizer in the bare step.
- The trainer step is the pretrain loop's own iteration (`pretrain._Loop.one_step` and its
  progress report when due) on Megatron's mock data, with the run's logging defaults.
- Phase times come from the loop's own seams (the data iterator, the schedule's
  `finalize_model_grads_func`, the trainer's `phase_hook`), wrapped with a clock, so the
  breakdown costs nothing when nobody measures.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

SHAPES: Dict[str, Dict] = {
    "issue": dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_experts=8,
                  moe_ffn_hidden_size=512, moe_router_topk=2, vocab_size=4096,
                  seq_length=256),
    "wide": dict(num_layers=4, hidden_size=512, num_attention_heads=8, num_experts=16,
                 moe_ffn_hidden_size=512, moe_router_topk=4, vocab_size=4096,
                 seq_length=512),
}
"""Issue 42's shape (4 layers, D 256, 4 heads with QK-norm, 8 SwiGLU experts of width 512,
top-2, vocab 4096, seq 256) and the wider one (D 512, 16 experts, top-4, seq 512)."""

TOKENS_PER_STEP = 1024
LATENT_DIVISOR = 4
"""Multi-View and its latent baseline run at latent L = D / 4 (the tiny presets' ratio is
D / 2; the 10B-A1B's D / 8)."""


def raw_run(shape: str = "issue", variant: str = "smoe", ep: int = 1, world: int = 1,
            log_interval: Optional[int] = None, routing_metrics: Optional[bool] = None) -> Dict:
    """The raw run config of `variant` at `shape`: fp32 (CPU), dropout off, QK-norm, Megatron's
    mock data, TOKENS_PER_STEP tokens per rank per step in one microbatch."""
    fields = dict(SHAPES[shape])
    model = dict(fields, moe_variant=variant, ffn_hidden_size=fields["moe_ffn_hidden_size"],
                 extra=dict(qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0))
    if variant in ("latent", "multi_router", "multi_view"):
        model["latent_size"] = fields["hidden_size"] // LATENT_DIVISOR
    if variant in ("multi_router", "multi_view"):
        model["multi_view"] = dict(num_routers=2, num_views=2 if variant == "multi_view" else 1,
                                   gamma_ramp_steps=0)
    micro = max(1, TOKENS_PER_STEP // fields["seq_length"])
    logging = dict(tensorboard=False)
    if log_interval is not None:
        logging["log_interval"] = log_interval
    if routing_metrics is not None:
        logging["routing_metrics"] = routing_metrics
    return dict(model=model, parallel=dict(ep=ep, distributed_timeout_seconds=600),
                # NullTokenizer's vocabulary is null_vocab_size + 1 (EOD): exactly vocab_size
                data=dict(mock=True, tokenizer_type="NullTokenizer",
                          null_vocab_size=fields["vocab_size"] - 1),
                optimizer=dict(lr=3e-4, min_lr=3e-5, warmup_iters=0, clip_grad=1.0),
                training=dict(train_iters=100000, global_batch_size=micro * world,
                              micro_batch_size=micro, eval_interval=0, eval_iters=0,
                              seed=1234),
                logging=logging)


def run_config(raw: Dict):
    from megatron_mvmoe.config.run_config import config_from_dict

    run = config_from_dict(copy.deepcopy(raw))
    run.validate()
    return run


def one_batch(run, seed: int = 0) -> Dict[str, torch.Tensor]:
    """One [B, S] microbatch of random tokens (labels = tokens shifted), every token counted."""
    model, micro = run.model, run.training.micro_batch_size
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.vocab_size, (micro, model.seq_length + 1), generator=gen)
    positions = torch.arange(model.seq_length).unsqueeze(0).expand(micro, -1).contiguous()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro, model.seq_length), "position_ids": positions}


class BareStep:
    """The hand-written loop around the same GPTModel: forward, loss, backward, clip, AdamW."""

    def __init__(self, run, pgs, clip: float = 1.0, config=None, adam_impl: str = "foreach"):
        """`adam_impl`: optimizer.torch_adam_impl's names; foreach (the hand-written loop's,
        torchtitan's), or the AdamW the trainer is configured with."""
        from megatron_mvmoe.models.build import build_model
        from megatron_mvmoe.training.adam_impl import IMPL_FLAGS

        self.model = build_model(run, pgs, config)[0]
        self.model.train()
        o = run.optimizer
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        foreach, fused = IMPL_FLAGS[adam_impl]
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.adam_beta1,
                                           o.adam_beta2), eps=o.adam_eps,
                                           weight_decay=o.weight_decay, foreach=foreach,
                                           fused=fused)
        self.clip = clip

    def __call__(self, batch: Dict[str, torch.Tensor]) -> float:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        # The aux-loss gradient scale the schedule sets before every forward (one microbatch);
        # Megatron's own default left by a bare backward has another shape than the schedule's.
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
        losses = self.model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        mask = batch["loss_mask"]
        loss = (losses.float() * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


CLOCKS: Dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""cpu: this process's CPU time (one thread: the work, whatever else shares the cores)."""

PHASES = ("data", "forward_backward", "grad_reduction", "optimizer", "logging", "other")


class PhaseClock:
    """Seconds per phase of the trainer's step, summed over the steps timed."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.now = clock
        self.seconds = {name: 0.0 for name in PHASES}
        self.mark = clock()

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def lap(self, phase: str) -> None:
        now = self.now()
        self.seconds[phase] += now - self.mark
        self.mark = now

    @contextmanager
    def timing(self, phase: str):
        start = self.now()
        try:
            yield
        finally:
            self.add(phase, self.now() - start)


def _timed_iterator(it: Iterator, clock: PhaseClock) -> Iterator:
    while True:
        with clock.timing("data"):
            item = next(it)
        yield item


class TrainerStep:
    """The pretrain loop's iteration (`_Loop.one_step`, the progress report when due) with
    its phases timed through the loop's seams."""

    def __init__(self, run, pgs, config, clock: Callable[[], float] = time.perf_counter):
        """`run`, `config`: as `rank_setup` left and returned them (the start-up is done
        there once; the loop reads with a tokenizer built when the data needs one)."""
        from megatron_mvmoe.training import pretrain
        from megatron_mvmoe.training.startup import Start

        self.loop = pretrain._Loop(Start(run, None, config), pgs, None)
        self.clock = PhaseClock(clock)
        self.iterators = [_timed_iterator(it, self.clock) for it in self.loop.iterators()]
        trainer = self.loop.trainer
        finalize = trainer.config.finalize_model_grads_func

        def timed_finalize(*args, **kwargs):
            with self.clock.timing("grad_reduction"):
                return finalize(*args, **kwargs)
        trainer.config.finalize_model_grads_func = timed_finalize
        trainer.phase_hook = self._phase_end
        self.steps = 0
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.interval = run.logging.log_interval

    def _phase_end(self, phase: str) -> None:
        if phase == "backward":  # everything since the step began, less the timed seams
            now = self.clock.now()
            inner = self.clock.seconds["data"] + self.clock.seconds["grad_reduction"]
            self.clock.add("forward_backward", now - self.step_start - (inner - self.inner_at))
            self.clock.mark = now
        elif phase == "optimizer":
            self.clock.lap("optimizer")

    def reset_clock(self) -> None:
        self.clock = PhaseClock(self.clock.now)
        self.steps_at_reset = self.loop.state.step

    def steps_timed(self) -> int:
        return self.loop.state.step - getattr(self, "steps_at_reset", 0)

    def __call__(self, batch=None) -> float:
        self.step_start = self.clock.now()
        self.inner_at = self.clock.seconds["data"] + self.clock.seconds["grad_reduction"]
        metrics = self.loop.one_step(self.iterators)
        self.clock.lap("other")  # scheduler, NaN verdict, gamma, bookkeeping
        self.window_steps += 1
        if self.loop.state.step % self.interval == 0:
            self.loop.report(metrics, time.perf_counter() - self.window_start, self.window_steps)
            self.window_start, self.window_steps = time.perf_counter(), 0
            self.clock.lap("logging")
        return metrics["loss"]

    def close(self) -> None:
        self.loop.close()


def interleaved(steppers: Dict[str, Callable[[], None]], rounds: int, steps: int,
                warmup: int = 2, clock: Callable[[], float] = time.perf_counter,
                after_warmup: Callable[[], None] = lambda: None) -> Dict[str, List[float]]:
    """Seconds per step of each stepper per round; each round runs every stepper `steps`
    times, the order rotated by one each round (a drift in machine load hits all alike)."""
    names = list(steppers)
    for name in names:
        for _ in range(warmup):
            steppers[name]()
    after_warmup()
    times = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            start = clock()
            for _ in range(steps):
                steppers[name]()
            times[name].append((clock() - start) / steps)
    return times


def ratio_summary(top: List[float], bottom: List[float]) -> Dict[str, float]:
    """Per-round ratios top / bottom: each, the median, min and max."""
    ratios = sorted(t / b for t, b in zip(top, bottom))
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else 0.5 * (ratios[mid - 1] + ratios[mid])
    return {"per_round": [t / b for t, b in zip(top, bottom)], "median": median,
            "min": ratios[0], "max": ratios[-1]}


def rank_setup(run):
    """(config, pgs) on an initialised default group, as the launcher's `run_config` does:
    tokenizer resolved, the run validated, the layout's groups built."""
    from megatron_mvmoe.data.run_data import resolve_tokenizer
    from megatron_mvmoe.models.build import validate_run
    from megatron_mvmoe.parallel import initialize_layout

    resolve_tokenizer(run)
    model = run.model
    config = validate_run(run, dist.get_world_size(), model.num_layers, model.num_experts)
    pgs = initialize_layout(run.parallel.layout(), model.num_layers, model.num_experts,
                            timeout_s=run.parallel.distributed_timeout_seconds)
    return config, pgs
