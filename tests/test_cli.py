"""The CLI: bad input is one line on stderr, exit code 2, and no output file."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from k3mono.cli import CHECK_LAYERS, CHECK_TOKENS, CHECK_TPS, main
from k3mono.iofiles import write_inputs
from k3mono.synthetic import random_inputs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    assert main(["make-checkpoint", str(folder / "ckpt"), "--preset", "tiny", "--layers", "1", "13", "--seed", "3"]) == 0
    return folder


def inputs_file(folder, name, cfg_tokens=2, layer=13, **replace):
    from k3mono.config import preset

    inputs = random_inputs(preset("tiny"), cfg_tokens, layer, seed=5)
    inputs.update(replace)
    path = folder / name
    write_inputs(path, inputs)
    return path


def run_args(folder, inputs, out, *extra):
    return ["run", "--checkpoint", str(folder / "ckpt"), "--layer", "13", "--inputs", str(inputs), "--out", str(out), *extra]


def test_make_checkpoint_writes_the_released_layout(ckpt):
    index = json.loads((ckpt / "ckpt" / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert "language_model.model.layers.13.block_sparse_moe.experts.55.w2.weight_scale" in names
    assert "language_model.model.layers.1.self_attn.o_proj.weight" in names
    assert json.loads((ckpt / "ckpt" / "config.json").read_text())["text_config"]["hidden_act"] == "situ"


def test_run_writes_the_four_outputs(ckpt):
    out = ckpt / "out.safetensors"
    assert main(run_args(ckpt, inputs_file(ckpt, "in.safetensors"), out, "--tp", "2", "--device", "cpu")) == 0
    got = load_file(str(out))
    assert {k: (list(v.shape), v.dtype) for k, v in got.items()} == {
        "moe_out": ([2, 224], torch.bfloat16),
        "prefix": ([2, 224], torch.bfloat16),
        "route_ids": ([2, 6], torch.int64),
        "route_weights": ([2, 6], torch.float32),
    }
    assert bool((got["route_ids"].diff(dim=-1) > 0).all())


def bad_cases(ckpt):
    good = inputs_file(ckpt, "good.safetensors")
    tiny_h = 224
    return [
        (run_args(ckpt, inputs_file(ckpt, "f32.safetensors", prefix=torch.zeros(2, tiny_h)), "o1"), "prefix: expected dtype"),
        (run_args(ckpt, inputs_file(ckpt, "shape.safetensors", prefix=torch.zeros(3, tiny_h, dtype=torch.bfloat16)), "o2"), "prefix"),
        (run_args(ckpt, inputs_file(ckpt, "many.safetensors", cfg_tokens=17), "o3"), "too many tokens"),
        (run_args(ckpt, good, "o4", "--tp", "3"), "tp"),
        (run_args(ckpt, good, "o5", "--tp", "8"), "does not divide"),
        (run_args(ckpt, good, "o6", "--impl", "fused"), "impl"),
        (run_args(ckpt, ckpt / "absent.safetensors", "o7"), "not found"),
        (["run", "--checkpoint", str(ckpt / "nowhere"), "--layer", "13", "--inputs", str(good), "--out", "o8"], "config.json"),
        (["run", "--checkpoint", str(ckpt / "ckpt"), "--layer", "7", "--inputs", str(good), "--out", "o9"], "layers.7"),
        (["run", "--checkpoint", str(ckpt / "ckpt"), "--layer", "0", "--inputs", str(good), "--out", "o10"], "layer"),
        (["bench", "--tp", "--out", "o11"], "nothing to run"),
        (["bench", "--tp", "8", "--contexts", "1024", "--out", "o12"], "--contexts"),
    ]


def test_bad_input_is_one_line_exit_2_and_no_output(ckpt, capsys):
    for args, message in bad_cases(ckpt):
        out = args[args.index("--out") + 1]
        args[args.index("--out") + 1] = str(ckpt / out)
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("k3mono: error: ") and err.count("\n") == 1, err
        assert message in err, (message, err)
        assert not (ckpt / out).exists()


def test_missing_shard_file_is_named(ckpt, tmp_path):
    import shutil

    broken = tmp_path / "ckpt"
    shutil.copytree(ckpt / "ckpt", broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["language_model.model.layers.13.block_sparse_moe.gate.weight"]
    (broken / victim).unlink()
    inputs = inputs_file(tmp_path, "in.safetensors")
    args = ["run", "--checkpoint", str(broken), "--layer", "13", "--inputs", str(inputs), "--out", str(tmp_path / "o")]
    proc = subprocess.run([sys.executable, "-m", "k3mono", *args], capture_output=True, text=True)
    assert proc.returncode == 2
    assert victim in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU that is absent")
def test_cuda_without_a_gpu_is_a_clear_error(ckpt, capsys):
    out = ckpt / "cuda.safetensors"
    assert main(run_args(ckpt, inputs_file(ckpt, "c.safetensors"), out, "--device", "cuda")) == 2
    assert "no GPU" in capsys.readouterr().err
    assert not out.exists()


def test_check_passes_on_its_built_in_default(tmp_path, capsys):
    assert main(["check", "--device", "cpu", "--keep", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "all within budget" in table
    runs = len(CHECK_LAYERS) * len(CHECK_TOKENS) * len(CHECK_TPS)
    for impl in ("reference", "staged", "mono"):
        assert sum(line.startswith(impl) for line in table.splitlines()) == runs, impl


def test_plan_shows_an_mla_layers_table_with_m1b_first(capsys):
    import re

    from k3mono.config import preset
    from k3mono.planner import BACK_BLOCK_DV

    assert main(["plan", "--tokens", "1", "--tp", "8", "--sms", "132", "--m1b-splits", "16"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^\d+-\d+\s", line)]
    cfg = preset("kimi-k3")
    m1b_tasks = cfg.num_attention_heads // 8 * cfg.v_head_dim // BACK_BLOCK_DV  # every head's value rows, BACK_BLOCK_DV a task
    assert rows[0].split()[1] == "M1B" and f"CORE[0]>={m1b_tasks}" in rows[1] and rows[1].split()[1] == "OPROJ"
    streamed = re.search(r"([\d.]+) MB weights streamed", out).group(1)
    assert re.search(rf"floor:\s+{streamed} MB weights", out), out


def test_plan_shows_a_split_tiles_last_part_on_its_own_line(capsys):
    """S = 8 at the mono defaults (mono.MONO_X_K_PARTS parts of K): the router's and
    the latent down's earlier parts raise their parts flag, the last part polls it
    in the task and raises the tile's push."""
    from k3mono.mono import MONO_X_K_PARTS

    assert main(["plan", "--tokens", "8", "--tp", "8", "--sms", "132"]) == 0
    rows = {line.split()[1] + " " + line.split()[4]: line for line in capsys.readouterr().out.splitlines()
            if line.split()[1:2] in (["ROUTER"], ["LATENT_DOWN"])}
    last, early = MONO_X_K_PARTS - 1, f"0..{MONO_X_K_PARTS - 2}"
    assert f"LOGIT_PARTS[0..6]>={last}(in task)" in rows[f"ROUTER {last}"] and "LOGITS[0]" in rows[f"ROUTER {last}"]
    assert rows[f"ROUTER {early}"].endswith("LOGIT_PARTS[0..6]")
    assert f"Z_PARTS[0..27]>={last}(in task)" in rows[f"LATENT_DOWN {last}"]
    assert rows[f"LATENT_DOWN {early}"].endswith("Z_PARTS[0..27]")


def test_bench_results_name_their_commit_and_a_tree_that_differs_from_it(tmp_path, monkeypatch):
    """bench's JSON names HEAD, with "-dirty" where tracked files differ from it
    (a tree copied beside a stale .git reads so); K3MONO_COMMIT overrides both."""
    from k3mono.bench import _git_commit

    monkeypatch.delenv("K3MONO_COMMIT", raising=False)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=k3mono", "-c", "user.email=k3mono@example.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "kernel.py").write_text("a = 1\n")
    subprocess.run([*git, "add", "kernel.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert _git_commit(tmp_path) == head
    (tmp_path / "kernel.py").write_text("a = 2\n")
    assert _git_commit(tmp_path) == f"{head}-dirty"
    monkeypatch.setenv("K3MONO_COMMIT", "abc1234")
    assert _git_commit(tmp_path) == "abc1234"
