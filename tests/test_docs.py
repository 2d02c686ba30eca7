"""The user docs: the README (a quickstart) and the site built from docs/ and the docstrings
(mkdocs.yml).

Theory of operation. Tests elsewhere run the docs' commands as written; the README used to
hold them all, and now most live in docs/guide/ pages. So the link between a page and the test
that runs its command is checked here, both ways: each command line a test quotes (in its
docstring, a constant, or the page it reads) appears verbatim in the page that promises it,
and the test file still quotes it. What mkdocs cannot see is checked too: the README's own
links (GitHub renders them; the site never builds the README itself, only the sections its
pages include), and internal issue numbers, which stay out of user docs (the README, the
guide, Porting, the API pages and the docstrings those render; DESIGN-NOTES and STATUS, the
developers' pages, may keep them). Last, the build command of scripts/test.sh, run on a copy
of the docs with one broken link, fails: strict mode counts only the warnings mkdocs logs, so
a ``-q`` there would let every broken reference through.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from tests_support import ROOT

DOCS = ROOT / "docs"
GUIDE = DOCS / "guide"
TESTS = ROOT / "tests"

# (the page, the command as the page shows it, the test that runs it, what that test quotes:
# the command itself unless given, in its docstring, a comment or a constant).
COMMANDS: list[tuple[Path, str, str, str | None]] = [
    (ROOT / "README.md", "pip install '.[torch,examples]'", "test_install.py", '"README.md"'),
    (
        ROOT / "README.md",
        "ftmesh launch -n 4 --kill-at 20 --join-at 40 examples/train_digits.py",
        "test_install.py",
        '"README.md"',
    ),
    (
        ROOT / "README.md",
        "ftmesh launch -n 3 examples/mnist_port.py",
        "test_training_port.py",
        None,
    ),
    (
        GUIDE / "running.md",
        "ftmesh worker --start-peers 3 examples/train_digits.py",
        "test_lab_doors.py",
        None,
    ),
    (
        GUIDE / "running.md",
        "ftmesh worker --discovery seeds --port 7946 --start-peers 4 train.py",
        "test_lab_doors.py",
        None,
    ),
    (
        GUIDE / "running.md",
        "ftmesh worker --discovery seeds --join 10.0.0.4:7946 --start-peers 4 train.py",
        "test_lab_doors.py",
        None,
    ),
    (
        GUIDE / "running.md",
        "ftmesh launch -n 2 --discovery seeds --join 10.0.0.4:7946 --start-peers 4 train.py",
        "test_lab_doors.py",
        None,
    ),
    (
        GUIDE / "membership.md",
        "ftmesh node --mesh lab --discovery mdns",
        "test_lab_doors.py",
        None,
    ),
    (
        GUIDE / "running.md",
        "ftmesh worker --discovery seeds --join 10.0.0.4:7946 --bind 0.0.0.0 --advertise"
        " 203.0.113.7 --port 7946 --data-port 7947 --state-port 7948 train.py",
        "test_lab_nat.py",
        None,
    ),
    (GUIDE / "running.md", "ftmesh status --watch", "test_live_view.py", '"status", "--watch"'),
    (
        GUIDE / "training.md",
        "ftmesh launch -n 3 examples/train_digits.py --compression int8 --eval-every 15"
        " --step-delay 0",
        "test_compression_training.py",
        None,
    ),
    (
        GUIDE / "training.md",
        "ftmesh launch -n 3 examples/train_digits.py --shares speed --epochs 2 --step-delay 0",
        "test_shares_training.py",
        None,
    ),
    (
        ROOT / "README.md",
        "ftmesh launch -n 3 --kill-at 6 --join-at 8 examples/train_digits.py --diloco 8"
        " --eval-every 2 --step-delay 0.7 --digest-every 1",
        "test_diloco_launch.py",
        '(ROOT / "README.md").read_text()',
    ),
    (
        DOCS / "PORTING.md",
        "ftmesh launch -n 3 --kill-at 6 --join-at 8 examples/train_digits.py --diloco 8"
        " --eval-every 2 --step-delay 0.7 --digest-every 1",
        "test_diloco_launch.py",
        None,
    ),
    (
        DOCS / "PORTING.md",
        "ftmesh launch -n 3 --kill-at 20 --join-at 21 examples/fabric_digits.py --step-delay 0.05",
        "test_lightning.py",
        None,
    ),
    (
        GUIDE / "benchmarks.md",
        ".venv/bin/ftmesh bench allreduce --procs 2 --sizes 64K,256K --iters 3 --plot busbw.png",
        "test_plots.py",
        'DOCS_ALLREDUCE = "bench allreduce --procs 2 --sizes 64K,256K --iters 3 --plot busbw.png"',
    ),
    (
        GUIDE / "lab.md",
        ".venv/bin/ftmesh lab chaos --hosts 3 --duration 10 --workload train --plot chaos.png",
        "test_plots.py",
        'DOCS_CHAOS = "lab chaos --hosts 3 --duration 10 --workload train --plot chaos.png"',
    ),
    (
        GUIDE / "benchmarks.md",
        ".venv/bin/ftmesh bench stragglers --procs 4 --slow-factor 4 --steps 60 --json",
        "test_bench_stragglers.py",
        'PAGE = ROOT / "docs" / "guide" / "benchmarks.md"',
    ),
]

USER_DOCS = [
    ROOT / "README.md",
    DOCS / "index.md",
    DOCS / "PORTING.md",
    *sorted(GUIDE.glob("*.md")),
    *sorted((DOCS / "api").glob("*.md")),
]
"""The pages users read (DESIGN-NOTES.md and STATUS.md are the developers')."""

ISSUE_NUMBER = re.compile(r"(?<![\w&/])#\d+\b|\b[Ii]ssues? #?\d+")
"""``#24``, ``issue 17``, ``issues 3``: this project's tracker, which users do not see."""


def _flat(text: str) -> str:
    """Text with shell line continuations joined and every run of whitespace one space."""
    return " ".join(text.replace("\\\n", " ").split())


@pytest.mark.parametrize(
    ("page", "command", "test", "quote"),
    COMMANDS,
    ids=[f"{page.stem}-{i}" for i, (page, _, _, _) in enumerate(COMMANDS)],
)
def test_each_command_a_test_runs_is_in_its_page(
    page: Path, command: str, test: str, quote: str | None
) -> None:
    assert command in _flat(page.read_text()), (
        f"{page.relative_to(ROOT)} no longer shows {command!r}"
    )
    source = _flat((TESTS / test).read_text())
    assert _flat(quote or command) in source, f"{test} no longer quotes {quote or command!r}"


def test_the_readme_is_a_quickstart_whose_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings == ["Install", "The demo", "Your own script", "Where to go next"], headings
    assert len(text.split()) < 1000, len(text.split())
    anchors = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
    targets = re.findall(r"\]\(([^)]+)\)", text)
    assert len(targets) >= 10, targets
    for target in targets:
        assert not target.startswith(("http:", "https:")), target  # nothing published to link
        path, _, anchor = target.partition("#")
        if path:
            assert (ROOT / path).exists(), f"README links {target}, which does not exist"
        else:
            assert anchor in anchors, f"README links #{anchor}, not a heading"
    # Every guide page is linked from the README, the way into the manual on GitHub.
    for page in GUIDE.glob("*.md"):
        assert f"(docs/guide/{page.name})" in text, page.name


def test_the_site_includes_the_readme_sections_it_names() -> None:
    """The home page and the training guide include the README's sections (pymdownx.snippets):
    each named section is marked in the README once, start and end."""
    text = (ROOT / "README.md").read_text()
    includes = re.findall(r'--8<-- "README\.md:(\w+)"', (DOCS / "index.md").read_text())
    includes += re.findall(r'--8<-- "README\.md:(\w+)"', (GUIDE / "training.md").read_text())
    assert {"what", "install", "demo", "port"} <= set(includes), includes
    for name in set(includes):
        for edge in ("start", "end"):
            assert text.count(f"<!-- --8<-- [{edge}:{name}] -->") == 1, (name, edge)


def _rendered_docstrings() -> dict[str, list[str]]:
    """The docstrings the API pages render (``::: dotted.name``), by name: a module's every
    string statement (the docstrings of the module, its classes and functions, and the
    attribute docstrings under assignments), or those of one class or function in it."""
    rendered: dict[str, list[str]] = {}
    for page in (DOCS / "api").glob("*.md"):
        for dotted in re.findall(r"^::: ([\w.]+)", page.read_text(), re.M):
            parts = dotted.split(".")
            for n in range(len(parts), 0, -1):
                base = ROOT.joinpath(*parts[:n])
                hit = [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()]
                if hit:
                    break
            else:
                raise AssertionError(f"{page.name}: {dotted} is no module of this tree")
            node: ast.AST = ast.parse(hit[0].read_text())
            for name in parts[n:]:  # the object inside the module, if one is named
                defs = [
                    d
                    for d in ast.iter_child_nodes(node)
                    if isinstance(d, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                    and d.name == name
                ]
                assert len(defs) == 1, f"{page.name}: {dotted} is not defined in {hit[0]}"
                node = defs[0]
            rendered[dotted] = [
                s.value.value
                for s in ast.walk(node)
                if isinstance(s, ast.Expr)
                and isinstance(s.value, ast.Constant)
                and isinstance(s.value.value, str)
            ]
    return rendered


def test_no_internal_issue_numbers_in_user_docs() -> None:
    assert len(USER_DOCS) >= 12, USER_DOCS
    for page in USER_DOCS:
        found = ISSUE_NUMBER.findall(page.read_text())
        assert not found, f"{page.relative_to(ROOT)}: {found}"
    rendered = _rendered_docstrings()
    assert "ftmesh.errors" in rendered and len(rendered) >= 12, sorted(rendered)
    assert len(rendered["ftmesh.torch.trainer.ElasticTrainer"]) >= 20  # its methods' too
    for dotted, docs in rendered.items():
        for doc in docs:
            found = ISSUE_NUMBER.findall(doc)
            assert not found, f"{dotted}: {found} in {doc[:80]!r}"
    assert ISSUE_NUMBER.findall("fixed (#28, item 3) and issue 13") == ["#28", "issue 13"]
    assert not ISSUE_NUMBER.findall("collective #N, `a#b`, &#39; and https://x/#12")


def _test_sh_build(site: Path) -> list[str]:
    """The docs build command of scripts/test.sh, as it runs there."""
    script = (ROOT / "scripts" / "test.sh").read_text()
    (line,) = re.findall(r"^.*\.venv/bin/mkdocs build.*$", script, re.M)
    command = re.search(r"\.venv/bin/mkdocs build[^)]*?(?= 2>&1|\))", line)
    assert command is not None, line
    argv = shlex.split(command.group(0).replace('"$docs_site"', str(site)))
    assert "--strict" in argv and "-q" not in argv and "--quiet" not in argv, argv
    return [str(ROOT / argv[0]), *argv[1:]]


@pytest.mark.slow
def test_the_ci_build_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The build scripts/test.sh runs passes on this tree and fails, naming it, on a link to a
    page that does not exist (on a copy of the docs; the package is linked, for the API)."""
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", tree)
    shutil.copy(ROOT / "README.md", tree)
    shutil.copytree(DOCS, tree / "docs")
    (tree / "ftmesh").symlink_to(ROOT / "ftmesh")
    env = {"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}

    def build(site: str) -> subprocess.CompletedProcess[str]:
        argv = _test_sh_build(tmp_path / site)
        return subprocess.run(
            argv, cwd=tree, env=env, capture_output=True, text=True, timeout=240
        )  # fmt: skip

    clean = build("clean")
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert (tmp_path / "clean" / "api" / "torch" / "index.html").exists()
    lab = tree / "docs" / "guide" / "lab.md"
    lab.write_text(lab.read_text() + "\nSee [the chaos page](chaos.md).\n")
    broken = build("broken")
    assert broken.returncode != 0
    said = broken.stdout + broken.stderr
    assert "'chaos.md'" in said and "Aborted with 1 warnings in strict mode" in said, said
