"""CLI shape, strict config, exit codes."""

import json

import pytest

from dflashkit.cli import COMMANDS, main
from dflashkit.config import RunConfig, config_from_dict, load_config
from dflashkit.errors import ConfigError
from dflashkit.family.contract import build_target_layer_ids


def last_json(capsys) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_unknown_keys_all_reported_with_did_you_mean():
    with pytest.raises(ConfigError) as ei:
        config_from_dict({"train": {"lrr": 1, "batch_size": "x"}, "drafter": {"blok_size": 4}, "nope": {}})
    msgs = "\n".join(ei.value.problems)
    assert len(ei.value.problems) == 4, msgs
    assert "train.lrr: unknown key (did you mean train.lr?)" in msgs
    assert "drafter.blok_size" in msgs and "drafter.block_size" in msgs
    assert "train.batch_size: expected int" in msgs


def test_overrides_and_validation(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  lr: 1e-3\ndrafter:\n  block_size: 8\n")
    cfg = load_config(p, ["drafter.block_size=4", "eval.block_sizes=[1,2]"])
    assert cfg.tokenize == RunConfig().tokenize  # sections the YAML and overrides do not name keep their defaults
    assert cfg.train.lr == 1e-3 and cfg.drafter.block_size == 4 and cfg.eval.block_sizes == [1, 2]
    with pytest.raises(ConfigError) as ei:
        load_config(p, ["train.lr=-1", "eval.top_p=2"])
    assert any(m.startswith("train.lr") for m in ei.value.problems)
    assert any(m.startswith("eval.top_p") for m in ei.value.problems)


def test_bad_config_exit_2_and_json_last_line(tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_text("train: {lrr: 1}\n")
    assert main(["doctor", "-c", str(p)]) == 2
    out = last_json(capsys)
    assert out["ok"] is False and out["exit_code"] == 2 and "train.lrr" in out["error"]
    p.write_text("train: [unclosed\n")
    assert main(["doctor", "-c", str(p)]) == 2
    err = last_json(capsys)["error"]
    assert f"{p}:" in err and "invalid YAML" in err


def test_every_command_has_help(capsys):
    for name in COMMANDS:
        assert main([name, "--help"]) == 0
    assert main([]) == 2


@pytest.mark.parametrize("layers,n,ids", [
    (64, 5, [1, 16, 31, 46, 61]), (36, 5, [1, 9, 17, 25, 33]), (61, 6, [1, 12, 24, 35, 47, 58]),
    (62, 5, [1, 16, 30, 44, 59]), (61, 5, [1, 15, 30, 44, 58]), (32, 5, [1, 8, 15, 22, 29]),
    (40, 5, [1, 10, 19, 28, 37]), (64, 10, [1, 8, 14, 21, 28, 34, 41, 48, 54, 61]), (36, 3, [1, 17, 33]),
    (36, 1, [18]), (24, 5, [1, 6, 11, 16, 21]), (28, 5, [1, 7, 13, 19, 25]), (16, 5, [1, 4, 7, 10, 13]),
])
def test_target_layer_ids_reference_formula(layers, n, ids):
    assert build_target_layer_ids(layers, n) == ids


def test_overrides_may_follow_flags(tmp_path, capsys):
    assert main(["doctor", "--json", f"run.run_dir={tmp_path}", "--log-level", "error", "run.seed=3"]) == 0
    assert last_json(capsys)["ok"] is True
    assert main(["doctor", "--bogus-flag"]) == 2


def test_optional_keys_left_at_default_keep_old_fingerprints():
    """drafter.draft_vocab_size (added later) is not hashed while null, so existing run dirs stay up to date;
    set, it changes the train fingerprint but not probe's (the data stages do not re-run)."""

    from dflashkit.config import config_to_dict, section_hash
    from dflashkit.stage_table import stage_hash

    cfg = load_config(None)
    flat = config_to_dict(cfg.drafter)  # the drafter.* keys as written: the family's knobs flat among them
    later = {"draft_vocab_size", "feature_scale", "type", "conv_kernel_size", "conv_group_size", "selector_rank",
             "selector_top_k", "input_embedding_scale", "output_multiplier",
             "final_logit_softcapping", "causal", "sliding_window", "layer_types", "attention_type",
             *(k for k in flat if k.startswith(("lilicorr_", "mla_", "dspark_")))}  # keys added after run dirs existed
    old = {k: v for k, v in flat.items() if k not in later}
    assert section_hash(cfg.drafter) == section_hash(old)
    d2 = load_config(None, ["drafter.type=dflash2"])  # the contract carries the drafter type: probe re-runs
    assert stage_hash("probe", d2) != stage_hash("probe", cfg)
    small = load_config(None, ["drafter.draft_vocab_size=1000"])
    assert section_hash(small.drafter) != section_hash(cfg.drafter)
    assert stage_hash("probe", small) == stage_hash("probe", cfg)
    assert stage_hash("train", small) != stage_hash("train", cfg)


def test_one_stage_table_keeps_commands_order_and_fingerprints():
    """The CLI, `run` and the run dir read one table; its fingerprints equal the ones `run` recorded before the
    table existed (the sections as `stages/pipeline.py` spelled them), so old run dirs stay up to date."""
    import dataclasses

    from dflashkit.cli import COMMANDS, READ_ONLY
    from dflashkit.config import section_hash
    from dflashkit.stage_table import PIPELINE, stage_hash
    from dflashkit.stages.pipeline import ORDER

    assert list(COMMANDS) == ["probe", "doctor", "plan", "prepare", "generate", "serve", "record", "tokenize", "capture",
                              "train", "eval", "export", "verify-engine", "import", "engines", "learn", "flywheel", "bench",
                              "gpu-check", "run",
                              "report"]
    assert COMMANDS["eval"][0] == "evaluate" and COMMANDS["import"][0] == "import_" and COMMANDS["run"][0] == "pipeline"
    assert READ_ONLY == {"doctor", "plan", "serve", "record", "engines", "gpu-check"}
    assert ORDER == PIPELINE == ("probe", "prepare", "generate", "tokenize", "capture", "train", "eval", "export",
                               "report")
    before = {
        "probe": lambda c: [c.target, dataclasses.replace(c.drafter, draft_vocab_size=None)],
        "prepare": lambda c: [c.data, c.run.seed],
        "generate": lambda c: [c.generate, c.server.model, c.target.path, c.target.chat_template],
        "tokenize": lambda c: [c.tokenize, c.target.tokenizer, c.target.chat_template],
        "capture": lambda c: [c.capture, c.train.loss, c.train.target_dtype, c.train.on_path == "rollout", c.run.seed,
                              c.train.heldout_samples, c.train.heldout_sources],  # the held-out paths it writes
        "train": lambda c: [c.train, c.drafter, c.run.seed],
        "eval": lambda c: [c.eval],
        "export": lambda c: [c.export],
        "report": lambda c: [],
    }
    for cfg in (load_config(None), load_config(None, ["train.lr=1e-3", "target.path=/x", "eval.num_prompts=3"])):
        for stage, sections in before.items():
            assert stage_hash(stage, cfg, "prev", "t") == section_hash(*sections(cfg), "prev", "t"), stage
    a, b = load_config(None), load_config(None, ["train.lr=1e-3"])
    assert stage_hash("train", a) != stage_hash("train", b) and stage_hash("eval", a) == stage_hash("eval", b)


def test_manifest_hash_comes_from_the_stage_table(tmp_path, tiny_qwen3, capsys):
    """probe's manifest records the table's hash of the config it reads plus the file it read."""
    from dflashkit.stage_table import stage_hash

    assert main(["probe", str(tiny_qwen3), "--run-dir", str(tmp_path), "--json"]) == 0
    manifest = json.loads((tmp_path / "probe" / "manifest.json").read_text())
    cfg = load_config(None)
    assert manifest["config_hash"] == stage_hash("probe", cfg, str(tiny_qwen3 / "config.json"))
    assert manifest["config_hash"] != stage_hash("probe", load_config(None, ["drafter.block_size=8"]),
                                                 str(tiny_qwen3 / "config.json"))


# issue #20: the checks train, tokenize, prepare and `run` once made when they ran are config checks
@pytest.mark.parametrize("override,key", [
    ("train.dpace_alpha=0", "train.dpace_alpha"), ("train.dpace_alpha=1.5", "train.dpace_alpha"),
    ("train.anchor_coverage=0", "train.anchor_coverage"), ("train.anchor_coverage=2", "train.anchor_coverage"),
    ("train.feature_noise=-0.1", "train.feature_noise"), ("tokenize.shard_size=0", "tokenize.shard_size"),
    ("tokenize.batch_size=0", "tokenize.batch_size"), ("data.num_prompts=0", "data.num_prompts"),
    ("data.heldout=-1", "data.heldout"), ("data.max_turns=0", "data.max_turns"),
    ("data.max_prompt_chars=0", "data.max_prompt_chars"), ("run.scale=0", "run.scale"),
])
def test_stage_option_checks_run_when_the_config_loads(override, key):
    with pytest.raises(ConfigError) as ei:
        config_from_dict({}, [override])
    assert len(ei.value.problems) == 1 and ei.value.problems[0].startswith(key), ei.value.problems


def test_stage_option_checks_accept_their_bounds_and_combine():
    edge = ["train.dpace_alpha=1", "train.anchor_coverage=1", "train.feature_noise=0", "tokenize.shard_size=1",
            "tokenize.batch_size=1", "data.num_prompts=1", "data.heldout=0", "data.max_turns=1",
            "data.max_prompt_chars=1", "train.optimizer=muon", "train.parallel.mode=ddp"]
    cfg = config_from_dict({}, edge)
    assert cfg.train.dpace_alpha == 1 and cfg.data.heldout == 0 and cfg.train.optimizer == "muon"
    with pytest.raises(ConfigError) as ei:
        config_from_dict({}, ["train.optimizer=muon", "train.parallel.mode=fsdp"])
    assert ei.value.problems == ["train.optimizer=muon does not support train.parallel.mode=fsdp (use ddp or none)"]


def test_yaml_boolean_spellings_of_a_choice_read_as_the_choice(tmp_path):
    """YAML 1.1 reads `off` as false: a Literal key with the choice "off" takes it back (generate.preflight)."""
    p = tmp_path / "r.yaml"
    p.write_text("generate:\n  preflight: off\n")
    assert load_config(p, []).generate.preflight == "off"
    assert load_config(p, ["generate.preflight=off"]).generate.preflight == "off"
    assert load_config(p, ["generate.preflight=warn"]).generate.preflight == "warn"
    with pytest.raises(ConfigError) as ei:  # a bool where no choice is spelt like it stays an error
        load_config(p, ["train.loss=true"])
    assert any(m.startswith("train.loss") for m in ei.value.problems)
