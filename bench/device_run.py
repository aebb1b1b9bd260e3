"""One device call (H200 or any CUDA machine): the steps to run are arguments, results land flat in ``--out``.

    python3 bench/device_run.py [--out DIR] [--log NAME] [--dry-run] STEP [STEP ...]
    python3 bench/device_run.py --preset h200_run6 [--dry-run]

Run it from the repository root. A step is ``kind[:target][,key=value|,flag]...``; ``+`` separates the
values of a list option (``world=2+4``). ``--dry-run`` prints the command lines a call would run (with
the ``timeout`` each runs under) and runs nothing. Kinds (defaults in brackets):

- ``no-multicast``: export ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1``.
- ``git``: a repository of this tree when none exists; ``git,fresh``: always a fresh one (``.git`` and
  ``.workbench`` removed first: a ``.git`` left from an earlier call has an older HEAD).
- ``isolated-path[,venv]``: make the carried packages in /tmp/site importable under ``python -I`` (a
  ``.pth`` in site-packages; ``venv``: else a venv of the base interpreter, used from then on).
- ``activate``: source ``.device/activate.sh`` into the environment when git, pydantic, typer or rich
  are not importable.
- ``versions[,count][,nccl]``: torch, CUDA, triton versions and the device (its count, NCCL's version).
- ``smi[,fields=a+b][,topo]``: ``nvidia-smi --query-gpu=...`` [name, driver, clocks, power, temperature].
- ``pytest:PATH[,timeout=150][,save=pytest_gpu.txt|-][,tail=5]``: ``pytest -q -m gpu PATH``.
- ``run:TASK[,candidate=P][,seed=1][,timeout=200][,no-queue][,save=NAME]``: ``workbench run`` on CUDA,
  timed; the newest result is copied to ``--out``/NAME. [candidate: the task's good ``triton-cuda``]
- ``bench:TASK[,candidate=P][,timeout=240][,reps=N][,no-compile][,world=W+W][,batch=B+B][,log-dir=D]
  [,hang-s=S]``: ``workbench bench``; ``log-dir`` keeps the ranks' logs there and prints their tails.
- ``bench-model:TASK[,candidate=P][,timeout=580][,steps=N][,mixed-steps=N][,profile-steps=N][,batches=B+B]
  [,contexts=C+C][,chunk=N]``: ``workbench bench-model`` on CUDA (its child's limit 20 s under the step's);
  writes ``k3_mini_bench_model.json``, ``.png``, ``.log`` to ``--out``. [candidate: the task's good ``triton-cuda``]
- ``calibrate:TASK[,raw=cal_raw.json][,aa=80][,planted=30][,timeout=150]``: perf_calibration ``collect``.
- ``calibrate-judged:TASK[,raw=..][,evaluated=..][,aa=40][,planted=20][,workload=k3_t8][,timeout=150]``:
  ``collect-judged`` on CUDA, then ``evaluate``.
- ``micro[,save=micro.json][,reps=30][,timeout=60]``: bench/dspark_micro.py.
- ``overhead[,save=judge_overhead_cuda.json][,timeout=120]``: bench/judge_overhead.py on CUDA.
- ``narrow-tp:FIXTURE[,task=k3_allreduce_rmsnorm][,tp=1+2]``: copy ``tasks/TASK/fixtures/FIXTURE`` to
  ``/tmp/cands/<name>-tp2`` with its SCOPE's ``tp_sizes=(1, 2, 4)`` narrowed.
- ``exploits[,budget=330][,case-timeout=180][,guard-limit=90][,cases=REGEX][,gpu=N][,archive=NAME]``: every
  GPU-only case of tests/exploits judged by ``pytest -m gpu``, one case per pytest under its own limit,
  writing ``pytest_gpu_exploits.txt`` and ``exploits_gpu_summary.json`` (``archive``: both as one tar.gz
  in ``--out`` instead); what it prints goes to the call's log.

:data:`PRESETS` holds the steps of every former ``bench/h200*_run*.sh`` and ``bench/h200_exploits.sh``
(the scripts that produced bench/results/h200*; their exact commands are in that README).

Raises (as exit code 2 with a one-line message): ``StepError`` for an unknown kind, option or preset.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's workbench (run as a file)
from workbench import envs  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SMI_FIELDS = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit,temperature.gpu"
GIT_BASE = "git init -q && git add -A && git -c user.name=wb -c user.email=wb@local commit -qm base"
SITE_PTH = "import sys; sys.path.insert(0, '/tmp/site'); import site; site.addsitedir('/tmp/site')"
"""A .pth line: /tmp/site first on the path, and its own .pth files read (CuTe DSL's adds its dsl_packages)."""


class StepError(ValueError):
    """A step string that names an unknown kind or option, or an unknown preset."""


@dataclasses.dataclass
class Cmd:
    """One command line: ``argv`` (``{py}`` is the interpreter), ``shell`` when it needs a shell."""

    argv: list[str] | str
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    save: str | None = None  # stdout and stderr to this file under --out (appended when append)
    append: bool = False
    tail: int = 0  # lines of ``save`` printed afterwards

    def line(self, py: str, out: Path) -> str:
        def fill(text: str) -> str:
            return text.replace("{py}", py).replace("{out}", str(out))
        body = fill(self.argv) if isinstance(self.argv, str) else shlex.join(fill(a) for a in self.argv)
        env = "".join(f"{k}={shlex.quote(v)} " for k, v in self.env.items())
        redirect = f" {'>>' if self.append else '>'} {shlex.quote(str(out / self.save))} 2>&1" if self.save else ""
        return env + body + redirect


@dataclasses.dataclass
class Note:
    """A step part done in Python (a copy, a tail, a summary): described in a dry run, run otherwise."""

    what: str
    fn: Callable[[Runner], None]


@dataclasses.dataclass
class Step:
    kind: str
    target: str | None
    opts: dict[str, str]


def parse_step(text: str) -> Step:
    """``kind[:target][,key=value|,flag]...`` as a :class:`Step`.

    Raises:
        StepError: the kind is unknown, or an option is not one the kind takes.
    """
    head, *rest = text.split(",")
    kind, _, target = head.partition(":")
    if kind not in KINDS:
        raise StepError(f"step {text!r}: unknown kind {kind!r}; known: {', '.join(KINDS)}.")
    opts = {}
    for r in rest:
        k, eq, v = r.partition("=")
        if k not in KINDS[kind][1]:
            raise StepError(f"step {text!r}: {kind} takes no option {k!r}; it takes: {', '.join(KINDS[kind][1]) or 'none'}.")
        opts[k] = v if eq else "1"
    return Step(kind, target or None, opts)


def _t(s: Step, default: int) -> list[str]:
    return ["timeout", s.opts.get("timeout", str(default))]


def _task(s: Step) -> str:
    if not s.target:
        raise StepError(f"step {s.kind}: needs a task, as {s.kind}:TASK.")
    return s.target


def _cand(s: Step) -> str:
    return s.opts.get("candidate", f"tasks/{_task(s)}/fixtures/good/triton-cuda")


def _newest_result(save: str) -> Note:
    def copy(r: Runner) -> None:
        results = sorted(Path(".workbench/results").glob("*.json"), key=lambda p: p.stat().st_mtime)
        if results:
            shutil.copy(results[-1], r.out / save)
    return Note(f"copy the newest .workbench/results/*.json to {save}", copy)


def _steps_git(s: Step) -> Iterator[Cmd | Note]:
    yield Cmd(f"rm -rf .git .workbench && {GIT_BASE}" if "fresh" in s.opts else f"[ -d .git ] || {{ {GIT_BASE}; }}")


def _steps_isolated_path(s: Step) -> Iterator[Cmd | Note]:
    def fix(r: Runner) -> None:
        def sees() -> bool:
            return subprocess.run([r.py, "-I", "-c", "import pydantic"], capture_output=True).returncode == 0
        if not sees():
            sp = subprocess.run(["python3", "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True).stdout.strip()
            try:
                Path(sp, "zz_wb_device.pth").write_text(SITE_PTH + "\n")
            except OSError:
                r.echo(f"site-packages {sp} not writable")
        if "venv" in s.opts and not sees():
            ts = subprocess.run(["python3", "-c", "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
                                capture_output=True, text=True).stdout.strip()
            subprocess.run(["python3", "-m", "venv", "--without-pip", "/tmp/wbvenv"], check=True)
            r.py = "/tmp/wbvenv/bin/python3"
            vsp = subprocess.run([r.py, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True).stdout.strip()
            Path(vsp, "zz_wb_device.pth").write_text(f"{SITE_PTH}\nimport site; site.addsitedir('{ts}')\n")
    yield Note("when `python3 -I` cannot import pydantic: a .pth putting /tmp/site first in its site-packages"
               + (" (else a venv of python3 at /tmp/wbvenv that adds torch's site-packages, used from then on)"
                  if "venv" in s.opts else ""), fix)
    if "venv" in s.opts:
        yield Cmd('{py} -I -c "import pydantic, torch, triton; print(\'python -I sees pydantic\', pydantic.VERSION, '
                  '\'torch\', torch.__version__)"')


def _steps_activate(s: Step) -> Iterator[Cmd | Note]:
    def act(r: Runner) -> None:
        if subprocess.run([r.py, "-c", "import git, pydantic, typer, rich"], capture_output=True).returncode == 0:
            return
        if Path(".device/activate.sh").is_file():
            got = subprocess.run(["bash", "-c", "source .device/activate.sh >&2 && env -0"], capture_output=True)
            if got.returncode:
                r.echo("WARNING: .device/activate.sh failed")
            else:
                os.environ.update(kv.split("=", 1) for kv in got.stdout.decode().split("\0") if "=" in kv)
    yield Note("when git, pydantic, typer or rich are not importable: source .device/activate.sh", act)


def _steps_versions(s: Step) -> Iterator[Cmd | Note]:
    extra = (", torch.cuda.device_count()" if "count" in s.opts else "") + ", torch.cuda.get_device_name()"
    extra += ", 'nccl', torch.cuda.nccl.version()" if "nccl" in s.opts else ""
    yield Cmd(f'{{py}} -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__{extra})"')


def _steps_smi(s: Step) -> Iterator[Cmd | Note]:
    yield Cmd(["nvidia-smi", f"--query-gpu={s.opts.get('fields', SMI_FIELDS).replace('+', ',')}", "--format=csv"])
    if "topo" in s.opts:
        yield Cmd(["nvidia-smi", "topo", "-m"])


def _steps_pytest(s: Step) -> Iterator[Cmd | Note]:
    argv = [*_t(s, 150), "{py}", "-m", "pytest", "-q", "-m", "gpu", s.target or "tests/kernels", "-p", "no:cacheprovider"]
    save = s.opts.get("save", "pytest_gpu.txt")
    if save == "-":
        yield Cmd(" ".join(argv) + f" 2>&1 | tail -{s.opts.get('tail', '5')}")
    else:
        yield Cmd(argv, save=save, tail=int(s.opts.get("tail", "5")))


def _steps_run(s: Step) -> Iterator[Cmd | Note]:
    argv = [*_t(s, 200), "{py}", "-m", "workbench", "run", _task(s), "--candidate", _cand(s), "--device", "cuda",
            "--seed", s.opts.get("seed", "1")] + (["--no-queue"] if "no-queue" in s.opts else [])
    t0 = []
    yield Note("start the verdict's wall clock", lambda r: t0.append(time.time()))
    yield Cmd(argv)
    yield Note("print the verdict's wall clock (s)", lambda r: r.echo(f"verdict wall: {int(time.time() - t0[-1])} s"))
    if "save" in s.opts:
        yield _newest_result(s.opts["save"])


def _steps_bench(s: Step) -> Iterator[Cmd | Note]:
    argv = [*_t(s, 240), "{py}", "-m", "workbench", "bench", _task(s), "--candidate", _cand(s), "--out", "{out}"]
    argv += [a for w in s.opts.get("world", "").split("+") if w for a in ("--world-size", w)]
    argv += [a for b in s.opts.get("batch", "").split("+") if b for a in ("--batch", b)]
    argv += ["--repetitions", s.opts["reps"]] if "reps" in s.opts else []
    argv += ["--no-compile"] if "no-compile" in s.opts else []
    env = {}
    if "log-dir" in s.opts:
        env = {envs.BENCH_LOG_DIR.name: s.opts["log-dir"], envs.BENCH_HANG_DUMP_S.name: s.opts.get("hang-s", "600")}
        yield Cmd(["mkdir", "-p", s.opts["log-dir"]])
    yield Cmd(argv, env=env)
    if "log-dir" in s.opts:
        def tails(r: Runner) -> None:
            for f in sorted(Path(s.opts["log-dir"]).glob("*.log")):
                r.echo(f"--- {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-40:]))
        yield Note(f"print the last 40 lines of each {s.opts['log-dir']}/*.log", tails)


def _steps_bench_model(s: Step) -> Iterator[Cmd | Note]:
    limit = int(s.opts.get("timeout", "580"))
    argv = [*_t(s, 580), "{py}", "-m", "workbench", "bench-model", "--candidate", _cand(s), "--task", _task(s),
            "--device", "cuda", "--out-dir", "{out}", "--timeout-s", str(max(30, limit - 20))]
    for opt in ("steps", "mixed-steps", "profile-steps", "chunk"):
        argv += [f"--{opt}", s.opts[opt]] if opt in s.opts else []
    for opt in ("batches", "contexts"):
        argv += [f"--{opt}", s.opts[opt].replace("+", ",")] if opt in s.opts else []
    yield Cmd(argv)


def _steps_calibrate(s: Step) -> Iterator[Cmd | Note]:
    yield Cmd([*_t(s, 150), "{py}", "-m", "guards.perf_calibration", "collect", _task(s),
               "{out}/" + s.opts.get("raw", "cal_raw.json"), "--aa", s.opts.get("aa", "80"),
               "--planted", s.opts.get("planted", "30")])


def _steps_calibrate_judged(s: Step) -> Iterator[Cmd | Note]:
    raw = "{out}/" + s.opts.get("raw", "perf_calibration_judged_raw.json")
    yield Cmd([*_t(s, 150), "{py}", "-m", "guards.perf_calibration", "collect-judged", _task(s), raw, "--device", "cuda",
               "--aa", s.opts.get("aa", "40"), "--planted", s.opts.get("planted", "20"),
               "--workload", s.opts.get("workload", "k3_t8")])
    yield Cmd(["{py}", "-m", "guards.perf_calibration", "evaluate", raw,
               "{out}/" + s.opts.get("evaluated", "perf_calibration_judged.json")])


def _steps_micro(s: Step) -> Iterator[Cmd | Note]:
    yield Cmd([*_t(s, 60), "{py}", "bench/dspark_micro.py", "{out}/" + s.opts.get("save", "micro.json"),
               s.opts.get("reps", "30")])


def _steps_overhead(s: Step) -> Iterator[Cmd | Note]:
    yield Cmd([*_t(s, 120), "{py}", "bench/judge_overhead.py", "{out}/" + s.opts.get("save", "judge_overhead_cuda.json"),
               "cuda"])


def _steps_narrow_tp(s: Step) -> Iterator[Cmd | Note]:
    task = s.opts.get("task", "k3_allreduce_rmsnorm")
    tp = ", ".join(s.opts.get("tp", "1+2").split("+"))
    src = f"tasks/{task}/fixtures/{s.target}"
    dest = f"/tmp/cands/{Path(s.target or '').name}-tp2"
    init = f"{dest}/k3_model/kernels/{task.removeprefix('k3_')}/__init__.py"
    yield Cmd(f"mkdir -p /tmp/cands && rm -rf {dest} && cp -r {src} {dest}")
    yield Cmd(["sed", "-i", f"s/tp_sizes=(1, 2, 4)/tp_sizes=({tp})/", init])
    yield Cmd(["grep", "-n", "tp_sizes", init])


def _steps_exploits(s: Step) -> Iterator[Cmd | Note]:
    budget, case_limit = int(s.opts.get("budget", "330")), int(s.opts.get("case-timeout", "180"))
    limit = s.opts.get("guard-limit", "90")
    env = {envs.CORPUS_GUARD_LIMIT_S.name: limit, envs.MODEL_EVAL["timeout_s"].name: limit}
    env |= {"CUDA_VISIBLE_DEVICES": s.opts["gpu"]} if "gpu" in s.opts else {}
    work = "/tmp/wb-h200-exploits.XXXXXX"  # made by mktemp when the step runs
    env[envs.CORPUS_SUMMARY.name] = f"{work}/cases.jsonl"
    sub = "exploits" if "archive" in s.opts else "."
    collect = Cmd(["{py}", "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests/exploits", "-p", "no:cacheprovider"],
                  env=env)
    case = Cmd(["timeout", "-k", "10", "LIMIT", "{py}", "-m", "pytest", "-q", "-m", "gpu", "CASE_ID", "-p",
                "no:cacheprovider", f"--basetemp={work}/ptI", "-rA"], env=env, save=f"{sub}/pytest_gpu_exploits.txt",
               append=True)

    def corpus(r: Runner) -> None:
        real = tempfile.mkdtemp(prefix="wb-h200-exploits.")
        for c in (collect, case):
            c.env = {k: v.replace(work, real) for k, v in env.items()}
            c.argv = [a.replace(work, real) for a in c.argv]
        _exploit_corpus(r, Path(real), collect, case, budget, case_limit, s.opts.get("cases", "."), r.out / sub)
        if "archive" in s.opts:
            with tarfile.open(r.out / s.opts["archive"], "w:gz") as tar:
                tar.add(r.out / sub, arcname=".")
            shutil.rmtree(r.out / sub)
    yield Note(f"the corpus (budget {budget} s, each case at most {case_limit} s): collect with `{collect.line('python3', Path(work))}`"
               f" > {work}/collect.txt; per collected id matching {s.opts.get('cases', '.')!r}, "
               f"`{case.line('python3', Path('OUT'))}` (LIMIT: the case limit or the budget left, I: the case's number); "
               f"then {sub}/exploits_gpu_summary.json" + (f", all packed into {s.opts['archive']}" if "archive" in s.opts
                                                         else ""), corpus)


def _exploit_corpus(r: Runner, work: Path, collect: Cmd, case: Cmd, budget: int, case_limit: int, pattern: str,
                    out: Path) -> None:
    """The corpus loop (see ``exploits`` in the module docstring): one pytest per collected case, then the summary."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    (work / "cases.jsonl").write_text("")
    (out / "pytest_gpu_exploits.txt").write_text("")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,"
                          "power.limit,temperature.gpu", "--format=csv,noheader"], capture_output=True, text=True)
    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True)
    r.echo(smi.stdout if smi.returncode == 0 else "WARNING: nvidia-smi failed")
    envinfo = {"python": sys.version.split()[0]}
    got = subprocess.run([r.py, "-c", _ENV_PROBE], capture_output=True, text=True)
    envinfo = json.loads(got.stdout) if got.returncode == 0 and got.stdout.strip() else envinfo
    r.echo(json.dumps(envinfo))
    col = subprocess.run([a.replace("{py}", r.py) for a in collect.argv], env={**os.environ, **collect.env},
                         capture_output=True, text=True)
    (work / "collect.txt").write_text(col.stdout + col.stderr)
    ids = [x for x in (col.stdout + col.stderr).splitlines() if "::" in x and re.search(pattern, x)]
    r.echo(f"{len(ids)} GPU case(s):\n" + "\n".join(ids))
    runs = []
    for i, cid in enumerate(ids, 1):
        name = cid.rsplit("[", 1)[-1].rstrip("]")
        left = budget - int(time.time() - t0)
        if left < 40:
            runs.append({"case": name, "pytest_rc": None, "wall_s": 0, "not_run": "time budget spent"})
            r.echo(f"== skip {name} (budget: {left} s left)")
            continue
        lim = min(left, case_limit)
        r.echo(f"== case {i}: {name} (limit {lim} s)")
        with open(out / "pytest_gpu_exploits.txt", "a") as f:
            f.write(f"===== {cid}\n")
            f.flush()
            argv = [a.replace("{py}", r.py).replace("LIMIT", str(lim)).replace("CASE_ID", cid)
                    .replace("/ptI", f"/pt{i}") for a in case.argv]
            t = time.time()
            rc = subprocess.run(argv, env={**os.environ, **case.env}, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc in (124, 137):
            _kill_leftovers(r, f"{work}/pt{i}")
        runs.append({"case": name, "pytest_rc": rc, "wall_s": int(time.time() - t)})
    judged = {}
    for x in (work / "cases.jsonl").read_text().splitlines():
        if x.strip():
            judged[json.loads(x)["case"]] = json.loads(x)
    cases = []
    for run in runs:
        c = {**judged.get(run["case"], {"case": run["case"]}), **run}
        if run.get("not_run"):
            c["status"] = "NOT_RUN"
        elif run["pytest_rc"] in (124, 137):
            c["status"] = c["status"] if c.get("status") in ("PASS", "FAIL", "ERROR") else "TIMEOUT"
            c["timed_out"] = True
        elif "status" not in c:
            c["status"] = "NO_RECORD"  # pytest ended before the case was judged (a skip or a collection error)
        c["actual"] = ("accepted" if c.get("accepted") else c.get("guard")) if "accepted" in c else None
        c["as_named"] = c.get("expected") is not None and c["actual"] == c.get("expected") and c["pytest_rc"] == 0
        cases.append(c)
    summary = {"script": "bench/device_run.py exploits", "environment": {**envinfo, "nvidia_smi": gpu.stdout.strip()},
               "cases": cases, "all_as_named": bool(cases) and all(c["as_named"] for c in cases)}
    (out / "exploits_gpu_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for c in cases:
        r.echo(f"{c['case']:55s} expected {str(c.get('expected')):12s} got {str(c.get('actual')):12s} "
               f"{c['status']:8s} {c.get('seconds', '-')} s  {'OK' if c['as_named'] else 'NOT AS NAMED'}")
    r.echo(f"all as named: {summary['all_as_named']}")


_ENV_PROBE = """import json, platform, sys
env = {"python": sys.version.split()[0], "platform": platform.platform()}
try:
    import torch
    env.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        env.update(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()))
except Exception as exc:
    env["torch_error"] = f"{type(exc).__name__}: {exc}"
for mod in ("triton", "pytest", "pydantic", "git"):
    try:
        env[mod] = __import__(mod).__version__
    except Exception as exc:
        env[mod] = f"missing ({type(exc).__name__})"
print(json.dumps(env))
"""


def _kill_leftovers(r: Runner, base: str) -> None:
    """End the guard children a killed case left behind: only processes whose command line names its folder."""
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if int(p.name) != os.getpid() and base.encode() in (p / "cmdline").read_bytes():
                os.kill(int(p.name), 9)
                r.echo(f"killed leftover process {p.name} of {base}")
        except (OSError, ValueError):
            continue


KINDS: dict[str, tuple[Callable[[Step], Iterator[Cmd | Note]], tuple[str, ...]]] = {
    "no-multicast": (lambda s: iter([Note("export " + " ".join(f"{k}={v}" for k, v in NO_MULTICAST.items()),
                                          lambda r: os.environ.update(NO_MULTICAST))]), ()),
    "git": (_steps_git, ("fresh",)),
    "isolated-path": (_steps_isolated_path, ("venv",)),
    "activate": (_steps_activate, ()),
    "versions": (_steps_versions, ("count", "nccl")),
    "smi": (_steps_smi, ("fields", "topo")),
    "pytest": (_steps_pytest, ("timeout", "save", "tail")),
    "run": (_steps_run, ("candidate", "seed", "timeout", "no-queue", "save")),
    "bench": (_steps_bench, ("candidate", "timeout", "reps", "no-compile", "world", "batch", "log-dir", "hang-s")),
    "bench-model": (_steps_bench_model, ("candidate", "timeout", "steps", "mixed-steps", "profile-steps", "batches",
                                         "contexts", "chunk")),
    "calibrate": (_steps_calibrate, ("raw", "aa", "planted", "timeout")),
    "calibrate-judged": (_steps_calibrate_judged, ("raw", "evaluated", "aa", "planted", "workload", "timeout")),
    "micro": (_steps_micro, ("save", "reps", "timeout")),
    "overhead": (_steps_overhead, ("save", "timeout")),
    "narrow-tp": (_steps_narrow_tp, ("task", "tp")),
    "exploits": (_steps_exploits, ("budget", "case-timeout", "guard-limit", "cases", "gpu", "archive")),
}

_MOE, _DS = "tasks/k3_moe_dispatch/fixtures/good/triton-cuda", "tasks/k3_dspark_verify/fixtures/good/triton-cuda"
_AR = "tasks/k3_allreduce_rmsnorm/fixtures/good/triton-nccl-cuda"
_SMI_X = "smi,fields=index+name+driver_version+clocks.sm+clocks.mem+clocks.max.sm"
PRESETS: dict[str, tuple[str, list[str]]] = {
    # name: (log file, steps); each the former bench/<name>.sh with its default knobs
    "h200_run": ("log.txt", ["git", "versions", "smi", "pytest:tests/kernels,timeout=150",
                             "run:k3_moe_dispatch,seed=3,save=run_result.json", "bench:k3_moe_dispatch,timeout=240",
                             "calibrate:k3_moe_dispatch,aa=80,planted=30,timeout=150"]),
    "h200_run2": ("log.txt", ["git", "smi", "pytest:tests/kernels,timeout=100,tail=3", "bench:k3_moe_dispatch,timeout=200",
                              "calibrate:k3_moe_dispatch,aa=40,planted=20,timeout=240"]),
    "h200_run3": ("log.txt", ["git", "smi", "bench:k3_moe_dispatch,timeout=200",
                              "run:k3_moe_dispatch,seed=11,timeout=150,save=run_result.json",
                              "calibrate:k3_moe_dispatch,raw=cal_raw2.json,aa=60,planted=0,timeout=150"]),
    "h200_run4": ("log.txt", ["git", "smi", "pytest:tests/kernels,timeout=100,tail=3",
                              "bench:k3_moe_dispatch,timeout=220"]),
    "h200_run5": ("log.txt", ["git", "versions", "smi",
                              "pytest:tests/tasks/test_k3_dspark_verify_triton.py,timeout=150,tail=15",
                              "run:k3_dspark_verify,seed=5,no-queue,save=run_result.json",
                              "bench:k3_dspark_verify,timeout=200,reps=100"]),
    "h200_run6": ("log.txt", ["isolated-path,venv", "git", "versions", "smi", "micro,reps=30,timeout=60",
                              "run:k3_dspark_verify,seed=6,timeout=120,no-queue,save=dspark_run.json",
                              "bench:k3_dspark_verify,timeout=100,reps=60,no-compile",
                              "run:k3_moe_dispatch,seed=6,timeout=110,no-queue,save=moe_run.json",
                              "bench:k3_moe_dispatch,timeout=60,reps=100,no-compile"]),
    "h200_run7": ("log7.txt", ["no-multicast", "git,fresh", "versions,count", _SMI_X,
                               "pytest:tests/tasks/test_k3_allreduce_rmsnorm.py,timeout=120,save=-",
                               f"bench:k3_allreduce_rmsnorm,candidate={_AR},timeout=150,world=1,batch=1+8+64,reps=50",
                               "exploits,budget=330"]),
    "h200_run8": ("log8.txt", ["no-multicast", "git,fresh",
                               f"bench:k3_allreduce_rmsnorm,candidate={_AR},timeout=200,world=1,reps=100",
                               f"run:k3_allreduce_rmsnorm,candidate={_AR},seed=41,no-queue,"
                               "save=k3_allreduce_rmsnorm_triton-nccl-cuda_1gpu_run.json"]),
    "h200_run9": ("log9.txt", ["isolated-path,venv", "git,fresh", "versions",
                               "smi,fields=name+driver_version+clocks.sm+clocks.mem+power.limit+temperature.gpu",
                               "run:k3_moe_dispatch,seed=9,no-queue,save=k3_moe_dispatch_triton-cuda_run9.json",
                               "run:k3_dspark_verify,seed=9,no-queue,save=k3_dspark_verify_triton-cuda_run9.json",
                               "calibrate-judged:k3_moe_dispatch,aa=40,planted=20,workload=k3_t8,timeout=150"]),
    "h200_run10": ("log10.txt", ["isolated-path", "git,fresh", "overhead,timeout=120",
                                 "calibrate-judged:k3_moe_dispatch,aa=20,planted=10,workload=k3_t8,timeout=400"]),
    "h200x2_run": ("log_x2.txt", ["no-multicast", "narrow-tp:good/triton-nccl-cuda",
                                  "narrow-tp:bad/perf-two-collectives-and-a-barrier", "git,fresh", "versions,count,nccl",
                                  _SMI_X + ",topo",
                                  "run:k3_allreduce_rmsnorm,candidate=/tmp/cands/triton-nccl-cuda-tp2,seed=21,timeout=240,"
                                  "no-queue,save=k3_allreduce_rmsnorm_triton-nccl-cuda-tp2_run.json",
                                  "bench:k3_allreduce_rmsnorm,candidate=/tmp/cands/triton-nccl-cuda-tp2,timeout=200,"
                                  "world=2,reps=100,log-dir=/tmp/benchlogs,hang-s=100",
                                  "run:k3_allreduce_rmsnorm,candidate=/tmp/cands/perf-two-collectives-and-a-barrier-tp2,"
                                  "seed=22,timeout=150,no-queue,save=k3_allreduce_rmsnorm_perf-two-collectives-and-a-barrier-tp2_run.json"]),
    "h200x4_run": ("log_x4.txt", ["no-multicast", "git,fresh", "versions,count,nccl", _SMI_X + "+power.limit+temperature.gpu,topo",
                                  f"run:k3_allreduce_rmsnorm,candidate={_AR},seed=21,timeout=300,no-queue,"
                                  "save=k3_allreduce_rmsnorm_triton-nccl-cuda_run.json",
                                  f"bench:k3_allreduce_rmsnorm,candidate={_AR},timeout=300,world=2+4,reps=100",
                                  "exploits,gpu=0,archive=exploits_h200.tar.gz"]),
    "h200_exploits": ("log.txt", ["git", "activate", "exploits"]),
    # K3-mini end to end, batch 1-64 x context 128-32k (issue 15 item 2): ~4 min estimated (1 min of prefill,
    # ~5 s per configuration); stopped at 400 s with the configurations done so far kept if that is wrong
    "h200_bench_model": ("log_bench_model.txt", ["git,fresh", "versions", "smi",
                                                 "bench-model:k3_moe_dispatch,timeout=420,steps=50,mixed-steps=4,"
                                                 "profile-steps=2"]),
}


class Runner:
    """Runs (or, with ``dry``, prints) the parts of each step in order, teeing output to the log."""

    dry = False

    def __init__(self, out: Path, log: Path | None, py: str = "python3") -> None:
        self.out, self.log, self.py = out, log, py

    def echo(self, text: str) -> None:
        print(text, flush=True)
        if self.log and not Runner.dry:
            with open(self.log, "a") as f:
                f.write(text + "\n")

    def plan(self, steps: list[str]) -> list[tuple[str, list[Cmd | Note]]]:
        """Each step string with its parts. Raises: StepError for a malformed step."""
        return [(t, list(KINDS[(s := parse_step(t)).kind][0](s))) for t in steps]

    def go(self, steps: list[str]) -> int:
        """Run (or print) every step; returns 0 (a failing command is logged and the call goes on, as before)."""
        for text, parts in self.plan(steps):
            self.echo(f"== {time.strftime('%T')} {text}" if not Runner.dry else f"# {text}")
            for p in parts:
                if isinstance(p, Note):
                    self.echo(f"#   ({p.what})") if Runner.dry else p.fn(self)
                elif Runner.dry:
                    self.echo(p.line(self.py, self.out))
                else:
                    self._cmd(p)
        return 0

    def _cmd(self, c: Cmd) -> None:
        line = c.line(self.py, self.out)
        self.echo(f"$ {line}")
        if c.save:
            (self.out / c.save).parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        for out_line in proc.stdout:
            self.echo(out_line.rstrip("\n"))
        if proc.wait():
            self.echo(f"(exit {proc.returncode})")
        if c.save and c.tail:
            self.echo("\n".join((self.out / c.save).read_text(errors="replace").splitlines()[-c.tail:]))


app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    steps: list[str] = typer.Argument(None, help="Steps, in order (see the module docstring); none with --preset."),
    out: Path = typer.Option(Path("bench/out"), "--out", help="Folder the results land in (flat)."),
    log: str = typer.Option("", "--log", help="Log file name under --out [the preset's, else log.txt]."),
    preset: str = typer.Option("", "--preset", help=f"Steps of a former script: {', '.join(PRESETS)}."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the command lines; run nothing."),
) -> None:
    """Run the given device steps (or a preset's) from the repository root."""
    try:
        if preset and preset not in PRESETS:
            raise StepError(f"--preset {preset!r}: unknown; known: {', '.join(PRESETS)}.")
        if bool(preset) == bool(steps):
            raise StepError("give either steps or --preset (one of them).")
        log_name, todo = PRESETS[preset] if preset else ("log.txt", list(steps))
        Runner.dry = dry_run
        out = out.absolute()
        runner = Runner(out, out / (log or log_name))
        runner.plan(todo)  # every step checked before anything runs or is made
        if not dry_run:
            out.mkdir(parents=True, exist_ok=True)
            os.environ.update(PYTHONUNBUFFERED="1", OUT=str(out))
        runner.go(todo)
        if not dry_run:
            runner.echo("\n".join(sorted(p.name for p in out.iterdir())))
    except StepError as exc:
        typer.echo(f"device_run: {exc}", err=True)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
