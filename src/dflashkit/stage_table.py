"""The one table of commands and stages: name, module, help, the config each stage reads.

Usage:
    from dflashkit.stage_table import PIPELINE, STAGES, stage_hash
    STAGES["eval"].module                     # "evaluate" (dflashkit.stages.evaluate)
    PIPELINE                                  # ("probe", "prepare", ..., "report"): `dflashkit run`'s order
    stage_hash("train", cfg)                  # the manifest's config_hash for train
    stage_hash("probe", cfg, str(source))     # plus what the stage reads that is not config

`cli` builds its commands from it, `stages/pipeline` its order and fingerprints, `rundir` its stage
list, and each stage's `manifest.json` its `config_hash`. The table names modules (it is library code
and may not import the stages); `cli` and `run` import `dflashkit.stages.<module>` when a command runs,
so `dflashkit doctor` does not import torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from dflashkit.config_hash import section_hash

if TYPE_CHECKING:
    from dflashkit.config import RunConfig


@dataclass(frozen=True)
class Stage:
    """One command. `sections` is the config it reads (its part of `run`'s fingerprint and of its manifest's
    config_hash); `pipeline` says whether `dflashkit run` runs it; `writes` whether it holds the run-dir lock."""

    name: str
    module: str
    help: str
    sections: Callable[[RunConfig], list[Any]] = lambda c: []
    pipeline: bool = False
    writes: bool = True


# In `dflashkit --help` order; the pipeline stages in the order `run` runs them. Probe does not read the
# draft vocab size (train does), so changing it re-runs train onwards, not the data stages. A stage's
# fingerprint also chains the one before it, so a target change reaches eval through probe.
TABLE: tuple[Stage, ...] = (
    Stage("probe", "probe", "Read a target's config + tokenizer files; write the drafter contract.",
          lambda c: [c.target, dataclasses.replace(c.drafter, draft_vocab_size=None)], pipeline=True),
    Stage("doctor", "doctor", "Check the environment: packages, devices, configured endpoints.", writes=False),
    Stage("plan", "plan", "Estimate disk, memory and time for a probed target and a data size.", writes=False),
    Stage("prepare", "prepare", "Read, normalise, dedupe, mix and split prompt sources.",
          lambda c: [c.data, c.run.seed], pipeline=True),
    Stage("generate", "generate", "Regenerate assistant turns with the target via an OpenAI-compatible server.",
          lambda c: [c.generate, c.server.model, c.target.path, c.target.chat_template], pipeline=True),
    Stage("serve", "serve", "OpenAI-compatible HTTP server over a local HF model (optionally with a drafter).",
          writes=False),
    Stage("record", "record", "Recording proxy in front of an OpenAI-compatible server: every answered request "
          "becomes a training record.", writes=False),
    Stage("tokenize", "tokenize", "Render with the target's chat template; build input_ids + loss masks.",
          lambda c: [c.tokenize, c.target.tokenizer, c.target.chat_template], pipeline=True),
    Stage("capture", "capture", "Cache target features at target_layer_ids into safetensors shards.",
          lambda c: [c.capture, c.train.loss, c.train.target_dtype, c.train.on_path == "rollout", c.run.seed,
                     c.train.heldout_samples, c.train.heldout_sources], pipeline=True),
    Stage("train", "train", "Train the drafter (one process, or under torchrun).",
          lambda c: [c.train, c.drafter, c.run.seed, *([c.capture.dtype] if c.train.features == "engine" else [])],
          pipeline=True),
    Stage("eval", "evaluate", "Lossless speculative decoding: tau, per-position acceptance, speedup.",
          lambda c: [c.eval], pipeline=True),
    Stage("export", "export", "Write the drafter dir SGLang/vLLM load (z-lab or speculators format); reload, compare.",
          lambda c: [c.export], pipeline=True),
    Stage("verify-engine", "verify_engine", "Serve the target + exported drafter in vLLM; check greedy outputs, "
          "tau and per-position acceptance against dflashkit's decoder.", lambda c: [c.eval, c.target]),
    Stage("import", "import_", "Import a drafter dir (z-lab or speculators format) to continue training or evaluate.",
          lambda c: [c.target]),
    Stage("engines", "engines", "Serving engines dflashkit starts for you: `engines install vllm`, `engines status`.",
          writes=False),
    Stage("learn", "learn", "Fine-tune the serving drafter on recorded traffic; promote it when a paired "
          "held-out score says it is better (rounds: --rounds, --every).", lambda c: [c.learn, c.train]),
    Stage("flywheel", "flywheel", "The flywheel demo: serve with recording, replay traffic, learn and hot-swap, "
          "round after round; print the curve.", lambda c: [c.learn, c.train, c.serve]),
    Stage("bench", "bench", "Benchmarks: generate | tokenize | train | decode | serve endpoints | recipe ablations."),
    Stage("gpu-check", "gpu_check", "Check the CUDA paths (flex attention, bf16 on an 8B-shaped target, CPU = GPU, "
          "the GPU decoder, 1 = 2 ranks) in time-boxed checks; write OUT_DIR/summary.json.", writes=False),
    Stage("run", "pipeline", "Run every stage from one YAML, skipping those that are up to date."),
    Stage("report", "report", "One self-contained HTML page (+ PNGs) from a run directory.", pipeline=True),
)
STAGES: dict[str, Stage] = {s.name: s for s in TABLE}
PIPELINE: tuple[str, ...] = tuple(s.name for s in TABLE if s.pipeline)
READ_ONLY: frozenset[str] = frozenset(s.name for s in TABLE if not s.writes)


def stage_hash(name: str, cfg: RunConfig, *extra: Any) -> str:
    """The hash of the config stage `name` reads (plus `extra`: inputs that are not config)."""
    return section_hash(*STAGES[name].sections(cfg), *extra)
