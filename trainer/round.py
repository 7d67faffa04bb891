"""One GRPO round: `run_round(config) -> RoundResult`. Trains `config.model_path` on `config.train_path` with TRL's
GRPOTrainer and leaves in `config.output_dir` (trainer.run_folder names the files) the progress lines, the status,
and `merged/`: the full model (LoRA merged in) with the base's processor, loadable as the verifier loads it, written
aside and renamed so that a folder called `merged` is always complete.

A STOP file or SIGTERM ends the round after the step in flight (a STOP file present from the start: after step 1),
stopped and saved. Under `accelerate launch` prefer the STOP file: the launcher does not wait for workers it passed
SIGTERM on to (`--multi_gpu` SIGKILLs them 30 s later, which can cut a save short; the CPU launcher exits at once).
A non-finite loss, gradient norm or reward fails the round (kind nan) without saving; an exception fails it with its
type, message and traceback tail (kind out_of_memory or error).

Works the same under plain `python -m trainer` (one process) and `accelerate launch --num_processes N` (CPU or GPU):
TRL/accelerate do the data-parallel work; everything written to disk is written by the main process.
"""

from __future__ import annotations

import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from peft import LoraConfig, PeftModel
from transformers import AutoConfig, AutoProcessor, GenerationConfig, Qwen2VLForConditionalGeneration
from transformers.image_utils import SizeDict
from trl import GRPOConfig

from evaluator.generation import generate_completions
from evaluator.gpu_memory import cap_gpu_memory
from evaluator.protocol import extract_answer, parse_gold
from evaluator.vision_attention import use_batched_vision_attention
from trainer import memory
from trainer.config import ConfigError, TrialConfig
from trainer.cpu_loss import completion_positions_only
from trainer.data import build_ood_subset, build_train_dataset
from trainer.kernels import apply_liger_kernels, use_liger
from trainer.layout import BatchLayout, batch_layout
from trainer.failure import describe_exception
from trainer.policy import freeze_untrained, lora_target_pattern, policy_dtype
from trainer.progress import FORMAT_RATE, ProgressCallback, StopRequest, format_rate
from trainer.rewards import build_reward_funcs
from trainer.rollout import ReplicaGRPOTrainer, RolloutReplica
from trainer.run_folder import (
    MERGED_DIR,
    PROGRESS_FILE,
    STATUS_FILE,
    FailureKind,
    RoundState,
    Status,
    earliest_rank_failure,
    rank_failure_files,
    write_rank_failure,
    write_status,
)

TRL_DIR = "trl"  # the trainer's own output_dir (nothing is checkpointed there: save_strategy "no")
# Rows per greedy batch in the intermediate evaluation (64 rows of ~300 prompt + 256 new tokens: ~1 GB of KV cache
# for the 2B model; small next to training memory).
EVAL_BATCH_SIZE = 32


@dataclass
class RoundResult:
    state: RoundState  # COMPLETED, STOPPED or FAILED
    reason: str | None
    steps_done: int
    timings: dict[str, float] = field(default_factory=dict)
    merged_dir: str | None = None
    output_dir: str = ""
    kind: FailureKind | None = None  # when FAILED
    # How the options left to the round resolved: `liger_kernels` (bool), `checkpoint_every` (0: no gradient
    # checkpointing, n: every n-th layer), `micro_batches` (passes a step), `estimated_peak_gb` (trainer.memory; None
    # off CUDA).
    settings: dict[str, Any] = field(default_factory=dict)


def run_round(config: TrialConfig) -> RoundResult:
    """Train one round as configured; never raises for a training problem (the result and status.json say it)."""
    start = time.monotonic()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    distributed = PartialState()  # under accelerate launch / torchrun this joins the process group
    is_main = distributed.is_main_process
    if is_main:
        _clear_previous_outputs(out)
    stop = StopRequest(out)
    stop.install()
    timings = {"setup": 0.0, "train": 0.0, "save": 0.0}
    state, kind, reason, steps_done, merged = RoundState.FAILED, FailureKind.ERROR, None, 0, None
    progress: ProgressCallback | None = None
    settings: dict[str, Any] = {}
    try:
        layout = batch_layout(config, distributed.num_processes)
        cap_gpu_memory(distributed.device, config.gpu_memory_gb)  # a round too big for that card fails here too
        trainer, progress = _build_trainer(config, layout, start, stop, distributed.device, settings)
        timings["setup"] = time.monotonic() - start

        began = time.monotonic()
        with nullcontext() if distributed.device.type == "cuda" else completion_positions_only():
            trainer.train()
        timings["train"] = time.monotonic() - began
        steps_done = trainer.state.global_step

        if progress.failure is not None:
            kind, reason = FailureKind.NAN, progress.failure  # poisoned weights: nothing worth saving
        else:
            stopped_early = progress.stop_reason is not None and steps_done < config.steps
            state, kind = (RoundState.STOPPED if stopped_early else RoundState.COMPLETED), None
            reason = progress.stop_reason if stopped_early else None
            began = time.monotonic()
            if is_main:
                merged = str(save_merged(trainer, config))
            timings["save"] = time.monotonic() - began
    except (Exception, KeyboardInterrupt) as exc:
        state, (kind, reason) = RoundState.FAILED, describe_exception(exc)
        if progress is not None:
            steps_done = progress.steps_done
        if distributed.num_processes > 1:
            write_rank_failure(out, distributed.process_index, kind, reason)
        if not is_main and not (out / STATUS_FILE).exists():
            rank_reason = f"rank {distributed.process_index}: {reason}"
            write_status(out, Status(state, rank_reason, steps_done, timings, kind))
    finally:
        stop.restore()
    if is_main:
        if state == RoundState.FAILED and kind != FailureKind.NAN:
            # The others usually only saw the collective break: the earliest failure of any process is the cause.
            first = earliest_rank_failure(out)
            if first is not None and first.rank != distributed.process_index:
                kind, reason = first.kind, f"rank {first.rank}: {first.reason}"
        write_status(out, Status(state, reason, steps_done, timings, kind))
    return RoundResult(state, reason, steps_done, timings, merged, str(out), kind, settings)


def _clear_previous_outputs(out: Path) -> None:
    """A re-run in the same folder starts a new round: old lines, status and failures would be read as its own.
    A STOP file is kept: it may have been written on purpose before the round got going."""
    for path in [out / PROGRESS_FILE, out / STATUS_FILE, *rank_failure_files(out)]:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------- building
def _build_trainer(
    config: TrialConfig, layout: BatchLayout, start: float, stop: StopRequest, device: torch.device,
    settings: dict[str, Any],
) -> tuple[ReplicaGRPOTrainer, ProgressCallback]:
    """The trainer, ready to train; `settings` receives how the options left to the round resolved."""
    on_gpu = device.type == "cuda"
    liger = use_liger(config, on_gpu)  # before any loading: a request that cannot be met fails at once
    reward_funcs, reward_weights = build_reward_funcs(config)
    train_dataset = build_train_dataset(config)
    if len(train_dataset) < layout.generation_prompts:
        raise ConfigError(
            "train_rows",
            f"{len(train_dataset)} train rows; one generation needs prompts_per_step x generation_steps = "
            f"{layout.generation_prompts} distinct prompts",
        )
    ood_rows = build_ood_subset(config)

    model = _load_model(config, on_gpu)
    if config.batched_vision_attention:  # the policy's forwards (old log-probs, training) run the tower too, frozen or not
        use_batched_vision_attention(model)
    if liger:
        apply_liger_kernels(model)
    if config.compile_training and on_gpu:
        # Regional compilation: the layers share their code, so one graph serves them all; compiled in place, the
        # parameter names stay those the replica's sync and the save read. Compilation is lazy, so with LoRA it
        # traces the layers as they are at the first step, with the adapters TRL puts in after this.
        for layer in model.model.language_model.layers:
            layer.compile(dynamic=True)
    plan = memory_plan(config, model, layout, device)
    peak_gb = None if plan.peak_bytes is None else round(plan.peak_bytes / memory.GiB, 2)
    settings.update(liger_kernels=liger, checkpoint_every=plan.checkpoint_every, micro_batches=plan.micro_batches,
                    estimated_peak_gb=peak_gb)  # fmt: skip
    processor = _training_processor(config)
    if FORMAT_RATE not in config.reward_weights:  # else the configured reward of that name is logged as it
        reward_funcs, reward_weights = reward_funcs + [format_rate], reward_weights + [0.0]
    args = _grpo_config(config, layout, reward_weights, on_gpu, plan)
    progress = ProgressCallback(
        config.output_dir,
        reward_names=list(config.reward_weights),
        start_time=start,
        stop=stop,
        eval_every=config.eval_every if ood_rows is not None else 0,
    )
    # The base checkpoint's dtype on GPU (bfloat16 for Qwen2-VL-2B) for the replica the rollouts are sampled from.
    replica = RolloutReplica(
        config.model_path, torch.bfloat16 if on_gpu else torch.float32, device, config.batched_vision_attention
    )
    trainer = ReplicaGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,  # with `format_rate` at weight 0: a logged diagnostic, see trainer.progress
        args=args,
        train_dataset=train_dataset,
        processing_class=processor,
        callbacks=[progress],
        peft_config=_lora_config(config),
        replica=replica,
        compile_rollouts=config.compile_rollouts and on_gpu,
    )
    if ood_rows is not None:
        # The verifier's own preprocessing: the base processor, not the training one with its max_pixels.
        progress.evaluate = _ood_evaluator(trainer, AutoProcessor.from_pretrained(config.model_path), ood_rows)
    progress.bind(trainer.accelerator)
    return trainer, progress


def _load_model(config: TrialConfig, on_gpu: bool) -> Qwen2VLForConditionalGeneration:
    model = Qwen2VLForConditionalGeneration.from_pretrained(
        config.model_path, dtype=policy_dtype(config, on_gpu), attn_implementation="sdpa"
    )
    freeze_untrained(model, config)
    return model


def card_bytes(config: TrialConfig, device: torch.device) -> float:
    """The GPU memory the round may use: the card's, or `gpu_memory_gb` when that is less."""
    total = torch.cuda.get_device_properties(device).total_memory
    return total if config.gpu_memory_gb is None else min(total, config.gpu_memory_gb * 1e9)


def memory_plan(config: TrialConfig, model: torch.nn.Module, layout: BatchLayout, device: torch.device) -> memory.Plan:
    """Micro-batches and checkpointed layers: `gradient_checkpointing` as configured (true: 1, false: 0) with the
    fewest micro-batches that fit, else chosen by memory (trainer.memory.plan; every layer when the vision tower
    trains, whose activations the estimate leaves out). On a CPU: one micro-batch, as configured or none, no
    estimate (peak_bytes None)."""
    configured = config.gradient_checkpointing
    if device.type != "cuda":
        return memory.Plan(1, 0 if configured is None else int(configured), None, True)
    footprint = memory.round_footprint(config, model, layout.per_device_train_batch_size)
    return memory.plan(footprint, card_bytes(config, device), every=memory.fixed_interval(config))


def _lora_config(config: TrialConfig) -> LoraConfig | None:
    pattern = lora_target_pattern(config)
    if pattern is None:
        return None
    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.effective_lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=pattern,
        bias="none",
    )


def _training_processor(config: TrialConfig) -> Any:
    """The processor TRL tokenizes with: left padding, images capped at `config.max_pixels`."""
    processor = AutoProcessor.from_pretrained(config.model_path, padding_side="left")
    image_processor = processor.image_processor
    # A new SizeDict rather than `max_pixels=` at load: transformers 5.17 writes that kwarg into the class-level
    # default `size` dict when the folder has none, changing every later processor in the process.
    image_processor.size = SizeDict(
        shortest_edge=image_processor.size["shortest_edge"], longest_edge=config.max_pixels
    )
    return processor


def _grpo_config(
    config: TrialConfig, layout: BatchLayout, reward_weights: list[float], on_gpu: bool, plan: memory.Plan
) -> GRPOConfig:
    # transformers' "constant" schedule ignores warmup; "constant_with_warmup" is the constant schedule with it.
    schedule = config.lr_schedule
    if schedule == "constant" and config.warmup_ratio > 0:
        schedule = "constant_with_warmup"
    return GRPOConfig(
        output_dir=str(Path(config.output_dir) / TRL_DIR),
        max_steps=config.steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type=schedule,
        warmup_steps=config.warmup_ratio,  # transformers 5: a float below 1 is a ratio of max_steps
        beta=config.beta,
        num_generations=config.num_generations,
        # A step's completions in plan.micro_batches passes: TRL counts steps_per_generation in passes.
        per_device_train_batch_size=layout.per_device_train_batch_size // plan.micro_batches,
        gradient_accumulation_steps=plan.micro_batches,
        steps_per_generation=layout.steps_per_generation * plan.micro_batches,
        temperature=config.temperature,
        loss_type=config.loss_type,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        scale_rewards=config.scale_rewards,
        max_completion_length=config.max_completion_length,
        reward_weights=reward_weights,
        bf16=on_gpu,  # GRPOConfig defaults bf16 to True, which on CPU would mean slow bf16 autocast
        gradient_checkpointing=plan.checkpoint_every > 0,
        # transformers' selective checkpointing; every layer when 1 (trainer.rollout keeps it across TRL's toggling).
        gradient_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": plan.checkpoint_every}
        if plan.checkpoint_every > 1
        else None,
        # Every trainable parameter is used in every step (every prompt has an image, so a trained vision tower is
        # too), so DDP need not search the graph for unused ones (TRL turns that search on for vision-language models).
        ddp_find_unused_parameters=False,
        # The reference model (full fine-tuning with beta > 0) only scores: bfloat16 halves its memory on GPU.
        model_init_kwargs={"dtype": "bfloat16"} if on_gpu and config.full_finetuning and config.beta > 0 else None,
        seed=config.seed,
        logging_steps=1,
        logging_nan_inf_filter=False,  # the default hides a NaN loss from the logs, and so from the NaN guard
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=on_gpu,
    )


def _ood_evaluator(trainer: ReplicaGRPOTrainer, processor: Any, rows: Any):
    """Greedy accuracy of the current policy on the OOD subset, prompted and decoded exactly as the verifier does: on
    the rollout replica, freshly synced, whose generation config is the base checkpoint's (the Trainer rewrote the
    policy's end-of-sequence ids). The dynamic cache: a static one would compile again for this batch size."""
    golds = [parse_gold(solution) for solution in rows["solution"]]

    def evaluate() -> dict[str, float]:
        trainer.replica.sync_from(trainer.accelerator.unwrap_model(trainer.model))
        completions = generate_completions(trainer.replica.model, processor, rows, batch_size=EVAL_BATCH_SIZE)
        answers = [extract_answer(completion.text) for completion in completions]
        correct = sum(answer is not None and answer == gold for answer, gold in zip(answers, golds, strict=True))
        return {
            "ood_accuracy": 100.0 * correct / len(golds),
            "ood_format_rate": sum(answer is not None for answer in answers) / len(golds),
        }

    return evaluate


# ---------------------------------------------------------------------------------------------------- saving
def save_merged(trainer: ReplicaGRPOTrainer, config: TrialConfig) -> Path:
    """The trained model with LoRA merged, in the base checkpoint's dtype, plus the base processor and generation
    config, written to `output_dir/merged` through a temporary sibling and a rename."""
    out = Path(config.output_dir)
    final, tmp = out / MERGED_DIR, out / f".{MERGED_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model = trainer.accelerator.unwrap_model(trainer.model)
    if isinstance(model, PeftModel):
        model = model.merge_and_unload(safe_merge=True)  # safe_merge: raises on NaN instead of saving garbage
    # The base's own config and generation config: training edits the live ones (Trainer sets use_cache=False and
    # copies the tokenizer's special ids over them), while the verifier generates from what is saved. The weights
    # go back to the base checkpoint's dtype (bfloat16 for Qwen2-VL-2B), which that config declares.
    base_config = AutoConfig.from_pretrained(config.model_path)
    if base_config.dtype is not None:
        model = model.to(base_config.dtype)
    model.config = base_config
    model.generation_config = GenerationConfig.from_pretrained(config.model_path)
    try:
        model.save_pretrained(tmp)
        # The base processor, untouched: the training one differs (left padding, the round's max_pixels), while the
        # verifier's preprocessing (qwen_vl_utils, then the processor) assumes the shipped settings.
        AutoProcessor.from_pretrained(config.model_path).save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk: give back what the half-written copy took
        raise
    shutil.rmtree(final, ignore_errors=True)  # a re-run of the same round replaces the old folder
    tmp.rename(final)
    return final
