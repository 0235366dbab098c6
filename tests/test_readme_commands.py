"""Galaxy-LM's documented command lines, and one for every other shipped training config, run as
written and finish, shortened with the documented overrides --max_steps 1 --max_eval_samples 8
(the profiler: --repeats 1 --warmup 0), so that none can rot; and so do Galaxy-LM-style configs
(tests/support/galaxy_lm_style.py: no model_path, so a random model of their shape).

The docs are held to that list: every line of docs/galaxy_lm.md's command block is a command run
here, as written, and every training command in README.md and docs/*.md (an entry script on a
shipped config, not --generate or --check) is run here with the same script, config and world.

Commands run from a scratch directory holding train_config/ and models/ (links into the
repository), as from a clean clone after the README's set-up, so outputs land in its runs/.
Command drivers (tests/support/command_driver.py) run many commands per process: one for the
single-process commands, and one per rank for the world-2 ones (each command gets its own
--init_method port). Every command must exit 0, and every training command's metrics file must
end with a finished run of 1 step. The drivers find matplotlib unimportable, so the trainer skips
its loss plot (about 0.5 s of CPU a run), as on the other tests' drivers; test_trainer_scripts.py
and test_trainer_plot.py draw it.
"""
import glob
import json
import os
import subprocess
import sys

from support.dist_pool import free_port
from support.galaxy_lm_style import (BART_CLASSIFY, BERT_FULL, BERT_GALAXY_LORA, BERT_PP_SIDE, LLAMA_FULL,
                                     LLAMA_PP_FULL, T5_GALAXY_CLASSIFY, T5_PP_FULL)

from galaxy.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = "--max_steps 1 --max_eval_samples 8"

SERIAL = [
    "python pretrain_bert.py",
    *[f"python pretrain_bert.py --config_file train_config/bert/{m}.json" for m in ("full", "lora", "adapter", "side")],
    "python finetune_llama.py --config train_config/llama/full.json",
    "python finetune_llama.py --config train_config/llama/lora.json",
    # the rest of the shipped training configs
    *[f"python finetune_llama.py --config train_config/llama/{m}.json" for m in ("adapter", "side", "classification")],
    "python finetune_llama.py --config train_config/gpt2/full.json",
    *[f"python finetune_{m}.py" for m in ("t5", "bart")],
    *[f"python finetune_{m}.py --config_file train_config/{m}/{c}.json" for m in ("t5", "bart") for c in ("lora", "adapter")],
    *[f"python finetune_{m}.py --config_file train_config/{m}/classify.json" for m in ("t5", "bart")],
    "python finetune_t5_side.py",
    "python finetune_t5_side.py --config_file train_config/t5/side_only.json",
    *[f"python finetune_bart.py --config_file train_config/bart/{c}.json" for c in ("side", "side_only")],
]
PROFILES = [f"python profile_flops.py --model {m} --config train_config/{m}/full.json" for m in ("bert", "bart")]
WORLD2 = [   # {r}: the rank
    "python pretrain_tp_bert.py --world 2 --rank {r}",
    "python pretrain_tp_bert.py --config_file train_config/bert/tp/full.json --world 2 --rank {r}",
    *[f"python pretrain_dp_bert.py --config_file train_config/bert/dp/{m}.json --world 2 --rank {{r}}"
      for m in ("full", "lora", "adapter", "side")],
    *[f"python pretrain_sp_bert.py --config_file train_config/bert/sp/{m}.json --world 2 --rank {{r}}"
      for m in ("full", "lora")],
    "python pretrain_pp_bert.py --rank {r} --world 2",
    *[f"python pretrain_pp_bert.py --rank {{r}} --world 2 --config_file train_config/bert/pp/{m}.json"
      for m in ("full", "lora", "side")],
    "python pretrain_galaxy.py --rank {r} --world 2",
    *[f"python pretrain_galaxy.py --rank {{r}} --world 2 --config_file train_config/bert/galaxy/{m}.json"
      for m in ("full", "lora")],
    "python finetune_pp_llama.py --rank {r} --world 2",
    "python finetune_pp_llama.py --rank {r} --world 2 --config train_config/llama/pp/full.json",
    "python finetune_llama.py --config train_config/llama/galaxy/full.json --world 2 --rank {r}",
    "python finetune_llama.py --config train_config/gpt2/galaxy/full.json --world 2 --rank {r}",
    "python finetune_pp_llama.py --rank {r} --world 2 --config train_config/gpt2/pp/full.json",
    *[f"python finetune_{m}.py --config_file train_config/{m}/galaxy/{c}.json --world 2 --rank {{r}}"
      for m in ("t5", "bart") for c in ("full", "classify")],
    "python finetune_pp_t5.py --rank {r} --world 2",
    *[f"python finetune_pp_t5.py --rank {{r}} --world 2 --config_file train_config/t5/pp/{m}.json"
      for m in ("lora", "adapter")],
    "python finetune_pp_bart.py --rank {r} --world 2",
    "python finetune_pp_bart.py --rank {r} --world 2 --config_file train_config/bart/pp/adapter.json",
    *[f"python finetune_pp_{m}.py --config_file train_config/{m}/pp/classify.json --world 2 --rank {{r}}"
      for m in ("t5", "bart")],
    "python finetune_dp_t5.py --rank {r} --world 2",
    *[f"python finetune_dp_t5.py --rank {{r}} --world 2 --config_file train_config/t5/dp/{m}.json"
      for m in ("lora", "adapter")],
]
# Galaxy-LM's own style: its keys, no model_path (written to the scratch directory's galaxy_lm/).
GALAXY_LM_CONFIGS = {"bert_full": BERT_FULL, "bert_galaxy_lora": BERT_GALAXY_LORA, "bert_pp_side": BERT_PP_SIDE,
                     "llama_full": LLAMA_FULL, "llama_pp_full": LLAMA_PP_FULL, "t5_pp_full": T5_PP_FULL,
                     "bart_classify": BART_CLASSIFY, "t5_galaxy_classify": T5_GALAXY_CLASSIFY}
GALAXY_LM_SERIAL = ["python pretrain_bert.py --config_file galaxy_lm/bert_full.json",
                    "python finetune_llama.py --config galaxy_lm/llama_full.json",
                    "python finetune_bart.py --config galaxy_lm/bart_classify.json"]
GALAXY_LM_WORLD2 = ["python pretrain_galaxy.py --rank {r} --world 2 --config galaxy_lm/bert_galaxy_lora.json",
                    "python finetune_t5.py --rank {r} --world 2 --config galaxy_lm/t5_galaxy_classify.json",
                    "python pretrain_pp_bert.py --rank {r} --world 2 --config galaxy_lm/bert_pp_side.json",
                    "python finetune_pp_llama.py --rank {r} --world 2 --config galaxy_lm/llama_pp_full.json",
                    "python finetune_pp_t5.py --rank {r} --world 2 --config galaxy_lm/t5_pp_full.json"]
# Those that give no model_path (a random model of their shape); the T5 one names the tiny T5.
RANDOM_MODELS = len(GALAXY_LM_SERIAL + GALAXY_LM_WORLD2) - 1
# Data Galaxy-LM users have: openassistant-guanaco's {"text"} records (and chat records) train finetune_llama.py.
GUANACO = [{"text": f"### Human: What does statement {i} do?### Assistant: It runs step {i}."} for i in range(6)] + [
    {"messages": [{"role": "user", "content": "Name a loop."}, {"role": "assistant", "content": "for"}]}] * 2
GUANACO_CONFIG = {"model_path": "models/tiny-llama", "train_path": "galaxy_lm/guanaco.jsonl", "batch_size": 4,
                  "pad_size": 32}
DATA_SERIAL = ["python finetune_llama.py --config galaxy_lm/guanaco.json"]
# Every training entry script and its default config (README.md's table).
DEFAULT_CONFIGS = {"pretrain_bert.py": "bert/full.json", "pretrain_tp_bert.py": "bert/tp/full.json",
                   "pretrain_sp_bert.py": "bert/sp/full.json", "pretrain_dp_bert.py": "bert/dp/full.json",
                   "pretrain_pp_bert.py": "bert/pp/full.json", "pretrain_galaxy.py": "bert/galaxy/full.json",
                   "finetune_llama.py": "llama/full.json", "finetune_pp_llama.py": "llama/pp/full.json",
                   "finetune_bart.py": "bart/full.json", "finetune_t5.py": "t5/full.json",
                   "finetune_t5_side.py": "t5/side.json",
                   "finetune_pp_bart.py": "bart/pp/full.json", "finetune_pp_t5.py": "t5/pp/full.json",
                   "finetune_dp_t5.py": "t5/dp/full.json"}
DOCUMENTED = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
GALAXY_LM_PAGE = os.path.join(ROOT, "docs", "galaxy_lm.md")


def config_of(command: str) -> str:
    words = command.split()
    for flag in ("--config_file", "--config"):
        if flag in words:
            return words[words.index(flag) + 1]
    return "train_config/" + DEFAULT_CONFIGS[words[1]]


def documented_commands(path: str) -> list[str]:
    """The `python ...` lines of a Markdown file's bash blocks: continuations joined, comments cut."""
    commands, in_bash, line = [], False, ""
    with open(path, encoding="utf-8") as f:
        for raw in f:
            text = raw.strip()
            if text.startswith("```"):
                in_bash = text == "```bash"
                continue
            if not in_bash:
                continue
            line += text.split(" #")[0].strip()
            if line.endswith("\\"):
                line = line[:-1].strip() + " "
                continue
            if line.startswith("python "):
                commands.append(" ".join(line.split()))
            line = ""
    return commands


def run_key(command: str) -> tuple[str, str, int]:
    """(script, config, world) of a command line."""
    words = command.split()
    world = int(words[words.index("--world") + 1]) if "--world" in words else 1
    return words[1], config_of(command), world


def test_galaxy_lm_command_lines_are_run_as_written():
    run = {" ".join(c.format(r=0).split()) for c in SERIAL + WORLD2 + PROFILES}
    lines = documented_commands(GALAXY_LM_PAGE)
    assert len(lines) >= 9
    assert [line for line in lines if line not in run] == [], "add these to SERIAL / WORLD2"


def test_every_documented_training_command_is_run():
    run = {run_key(c.format(r=0)) for c in SERIAL + WORLD2}
    missing = []
    for path in DOCUMENTED:
        for line in documented_commands(path):
            words = line.split()
            if words[1] not in DEFAULT_CONFIGS or "--generate" in words or "--check" in words:
                continue
            if not os.path.isfile(os.path.join(ROOT, config_of(line))):   # written by a command before it
                continue
            if run_key(line) not in run:
                missing.append(f"{os.path.relpath(path, ROOT)}: {line}")
    assert missing == [], "documented but not run here: add them to SERIAL / WORLD2"


def start_driver(tmp_path, name: str, commands: list[str]) -> subprocess.Popen:
    listing = tmp_path / f"{name}.json"
    listing.write_text(json.dumps(commands))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    driver = os.path.join(ROOT, "tests", "support", "command_driver.py")
    return subprocess.Popen([sys.executable, driver, ROOT, str(listing), "--without", "matplotlib"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_documented_commands_run_and_finish(tmp_path):
    for name in ("train_config", "models"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "galaxy_lm").mkdir()
    for name, keys in {**GALAXY_LM_CONFIGS, "guanaco": GUANACO_CONFIG}.items():
        (tmp_path / "galaxy_lm" / f"{name}.json").write_text(json.dumps(keys, indent=4))
    (tmp_path / "galaxy_lm" / "guanaco.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GUANACO))
    world2 = WORLD2 + GALAXY_LM_WORLD2
    ports = [free_port() for _ in world2]
    ranks = [[f"{c.format(r=r)} {QUICK} --init_method tcp://127.0.0.1:{p}" for c, p in zip(world2, ports)]
             for r in (0, 1)]
    serial = [f"{c} {QUICK}" for c in SERIAL + GALAXY_LM_SERIAL + DATA_SERIAL] + \
        [f"{c} --repeats 1 --warmup 0" for c in PROFILES]
    drivers = {"serial": start_driver(tmp_path, "serial", serial),
               **{f"rank{r}": start_driver(tmp_path, f"rank{r}", ranks[r]) for r in (0, 1)}}
    finished, outputs = {}, {}
    for name, proc in drivers.items():
        out, err = proc.communicate(timeout=1500)
        ends = [line.split(" ", 5) for line in out.splitlines() if line.startswith("@@ end ")]
        print(name, f"{sum(float(e[4]) for e in ends):.1f}s CPU", *(f"{wall}s ({cpu}s CPU) {command}"
                                                          for *_, wall, cpu, command in ends), sep="\n  ")
        assert proc.returncode == 0 and all(e[2] == "0" for e in ends), \
            f"{name}: exit {proc.returncode}, finished {[e[2:] for e in ends]}\n{err[-6000:]}"
        finished[name], outputs[name] = [command for *_, command in ends], (out, err)
    assert len(finished["serial"]) == len(serial) and len(finished["rank0"]) == len(world2)
    # Galaxy-LM's configs have no metrics_file: rank 0's summary says each run finished, and the
    # random models' note lines say what was built.
    out, err = outputs["rank0"][0] + outputs["serial"][0], outputs["rank0"][1] + outputs["serial"][1]
    assert out.count("done: 1 steps") == len(SERIAL + WORLD2 + GALAXY_LM_SERIAL + GALAXY_LM_WORLD2 + DATA_SERIAL)
    assert out.count("note: no model_path: a randomly initialised") == RANDOM_MODELS
    assert "warning: ignoring keys with no meaning here: fan_in_fan_out, merge_weights" in err
    assert ("guanaco.jsonl: 6 text records (loss on every token); 2 chat records (loss on the assistant turns, "
            "rendered with galaxy's ### Human / ### Assistant template)") in out

    for command in SERIAL + WORLD2:
        with open(os.path.join(ROOT, config_of(command))) as f:
            metrics = json.load(f)["metrics_file"]
        done = [r for r in read_metrics(tmp_path / metrics) if r.get("event") == "done"]
        assert done and all(r["steps"] == 1 for r in done), (command, done)
