"""Galaxy-LM's documented command lines, and one for every other shipped training config, run as
written and finish, shortened with the documented overrides --max_steps 1 --max_eval_samples 8
(the profiler: --repeats 1 --warmup 0), so that none can rot; and so do Galaxy-LM-style configs
(tests/support/galaxy_lm_style.py: no model_path, so a random model of their shape).

The docs are held to that list: every line of docs/galaxy_lm.md's command block is a command run
here, as written, and every training command in README.md and docs/*.md (an entry script on a
shipped config, not --generate or --check) is run here with the same script, config and world.

Commands run from a scratch directory holding train_config/ and models/ (links into the
repository), as from a clean clone after the README's set-up, so outputs land in its runs/. They
run on the session's command drivers (tests/support/script_runner.py's run_argvs: torch imported
once per driver for the whole suite), the single-process ones two at a time, then each world-2
one (its own --init_method port) on two. Every command must exit 0, and every training command's
metrics file must end with a finished run of 1 step. The drivers find matplotlib unimportable, so
the trainer skips its loss plot (about 0.5 s of CPU a run), as on the other tests' drivers;
test_trainer_scripts.py and test_trainer_plot.py draw it.

A command the list would run twice is run once: a shipped config named explicitly that is its
script's default config (`pretrain_bert.py --config_file train_config/bert/full.json` is
`python pretrain_bert.py`) adds nothing, and the docs check below compares (script, config, world).
"""
import glob
import json
import os
import shlex
import time

from support.galaxy_lm_style import (BART_CLASSIFY, BERT_FULL, BERT_GALAXY_LORA, BERT_PP_SIDE, LLAMA_FULL,
                                     LLAMA_PP_FULL, T5_GALAXY_CLASSIFY, T5_PP_FULL)
from support.script_runner import run_argvs

from galaxy.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = "--max_steps 1 --max_eval_samples 8"

SERIAL = [
    "python pretrain_bert.py",
    *[f"python pretrain_bert.py --config_file train_config/bert/{m}.json" for m in ("lora", "adapter", "side")],
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
    *[f"python pretrain_dp_bert.py --config_file train_config/bert/dp/{m}.json --world 2 --rank {{r}}"
      for m in ("full", "lora", "adapter", "side")],
    *[f"python pretrain_sp_bert.py --config_file train_config/bert/sp/{m}.json --world 2 --rank {{r}}"
      for m in ("full", "lora")],
    "python pretrain_pp_bert.py --rank {r} --world 2",
    *[f"python pretrain_pp_bert.py --rank {{r}} --world 2 --config_file train_config/bert/pp/{m}.json"
      for m in ("lora", "side")],
    "python pretrain_galaxy.py --rank {r} --world 2",
    "python pretrain_galaxy.py --rank {r} --world 2 --config_file train_config/bert/galaxy/lora.json",
    "python finetune_pp_llama.py --rank {r} --world 2",
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


def argv_of(command: str) -> list[str]:
    python, *argv = shlex.split(command)
    assert python == "python", command
    return argv


def test_documented_commands_run_and_finish(tmp_path):
    for name in ("train_config", "models"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "galaxy_lm").mkdir()
    for name, keys in {**GALAXY_LM_CONFIGS, "guanaco": GUANACO_CONFIG}.items():
        (tmp_path / "galaxy_lm" / f"{name}.json").write_text(json.dumps(keys, indent=4))
    (tmp_path / "galaxy_lm" / "guanaco.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GUANACO))
    serial = [f"{c} {QUICK}" for c in SERIAL + GALAXY_LM_SERIAL + DATA_SERIAL] + \
        [f"{c} --repeats 1 --warmup 0" for c in PROFILES]
    world2 = WORLD2 + GALAXY_LM_WORLD2
    # two processes at a time on the 2-core host: a world-2 command's ranks poll while they wait
    # (galaxy.distributed.waiting), which a third process beside them would slow down
    jobs = [[argv_of(c)] for c in serial] + \
        [[argv_of(f"{c.format(r=r)} {QUICK} --init_method tcp://127.0.0.1:{{port}}") for r in (0, 1)] for c in world2]
    start = time.perf_counter()
    results = run_argvs(jobs, cwd=str(tmp_path))      # without matplotlib: no loss plot
    print(f"{len(serial)} single-process and {len(world2)} world-2 commands: {time.perf_counter() - start:.1f} s")
    failed = [f"{' '.join(job[0])}: rank {r} exited {code}\n{err[-3000:]}"
              for job, outcome in zip(jobs, results) for r, (code, _, err) in enumerate(outcome) if code != 0]
    assert not failed, "\n".join(failed)
    # Galaxy-LM's configs have no metrics_file: rank 0's summary says each run finished, and the
    # random models' note lines say what was built.
    out = "".join(outcome[0][1] for outcome in results)
    err = "".join(outcome[0][2] for outcome in results)
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
