"""What the stages of a run refuse of the target itself, asked before the first of them does any work.

Usage:
    check_target(cfg, ["generate", "tokenize", "train", "eval"])   # exit 2, each stage's own message; or nothing

`dflashkit run` (and its dry run) calls it with the stages it will run, so a refusal that depends on the target
alone comes before generate's requests, tokenize, the budget's calibration or capture, not after them. The
checks are the stages' own functions, asked of the target's config.json and safetensors headers (no weight is
read): the greedy-path rollout's (`data.capturing`), vLLM's CPU build's (`engines.launch`) and the local load's
(`target.quantized`).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from dflashkit.data.capturing import rollout_reproduces_attention
from dflashkit.engines.launch import check_engine_architecture
from dflashkit.family.recipe import config_recipe
from dflashkit.target.files import resolve_target_path
from dflashkit.target.quantized import check_local_target

if TYPE_CHECKING:
    from dflashkit.config import RunConfig


def check_target(cfg: RunConfig, stages: list[str]) -> None:
    """The refusals of `stages` that depend on the target alone, made before the first of them does any work (the
    dry run too), from the target's config.json and safetensors headers, with the messages the stages give (exit 2):
    - train.on_path=rollout on a target with linear-attention / state-space layers, or a sliding window shorter
      than the greedy path (capture, train: `data.capturing.rollout_reproduces_attention`; the window over the
      longest sample is theirs to check once the data is tokenized);
    - vLLM's CPU build on such a target (server.engine=vllm for generate, capture.engine=vllm, train.features=
      engine, without capture.server_url: `engines.launch.check_engine_architecture`);
    - a target the local paths cannot load (an unsupported quantization, tensors its config cannot describe:
      `target.quantized.check_local_target`) where a stage loads it here: generate's own `dflashkit serve`, local
      capture, online training, eval.
    No target.path (a stage that needs one says so), a target not on disk yet (an asset that probe fetches), a
    GGUF file or a dir without config.json are left to the stages."""
    if not cfg.target.path or not Path(cfg.target.path).expanduser().exists():
        return
    model_dir, gguf = resolve_target_path(cfg.target.path, cfg.target.gguf_file)
    if gguf or not (model_dir / "config.json").is_file():
        return
    todo, recipe = set(stages), config_recipe(cfg)
    serves = "generate" in todo and not cfg.server.urls
    if recipe.rollout and todo & {"capture", "train"} and recipe.path_depth > 1:
        rollout_reproduces_attention(cfg, SimpleNamespace(input_ids=[]), recipe)
    own_vllm = not cfg.capture.server_url
    for needed, what in ((serves and cfg.server.engine == "vllm", "server.engine=vllm (server.urls is empty)"),
                         ("capture" in todo and cfg.capture.engine == "vllm" and own_vllm, "capture.engine=vllm"),
                         ("train" in todo and recipe.engine_fed and own_vllm, "train.features=engine")):
        if needed:
            check_engine_architecture(cfg, model_dir, what)
    if ((serves and cfg.server.engine == "dflashkit") or ("capture" in todo and cfg.capture.engine == "local")
            or ("train" in todo and recipe.online) or "eval" in todo):
        check_local_target(cfg.target)
