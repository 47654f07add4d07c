"""The package's shape, checked: no import circle (imports inside functions and under
``TYPE_CHECKING`` count too), imports of the package's own modules at the top of modules but
for the deliberate lazy ones below, no runtime module over 400 lines and no class over 300,
and a ``docs/architecture.md`` that names every module."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "s5loader"

# (importing module, imported module): the lazy imports kept on purpose, each with its reason
# in a comment where it is made.
LAZY_ALLOWED = {
    ("s5loader", "s5loader.dcp"),  # torch.distributed.checkpoint only when s5loader.dcp is used
    # s5loader prefetch takes its cache's lock before it loads torch
    ("s5loader._daemon.command", "s5loader._daemon.prefetch_options"),
    ("s5loader._daemon.command", "s5loader._daemon.prefetcher"),
}
MODULE_LINES = 400
CLASS_LINES = 300


def _parse(text: str) -> ast.Module:
    """``ast.parse``, again after CPython 3.11's spurious "AST constructor recursion depth
    mismatch" (gh-106905, fixed in 3.11.8): its converter keeps one depth counter for all
    threads, and a traceback that another thread formats meanwhile (3.11 parses source lines
    to place its carets) upsets it. Under pytest-xdist, threads of earlier tests can do so."""
    for _ in range(4):
        try:
            return ast.parse(text)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
    return ast.parse(text)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """The package modules ``name`` imports, each with whether the import is lazy (inside a
    function)."""
    is_pkg = path.name == "__init__.py"
    found: list[tuple[str, bool]] = []

    def target(base: str) -> str:
        while base not in modules and "." in base:
            base = base.rsplit(".", 1)[0]
        return base

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((target(a.name), inner) for a in child.names if a.name.startswith("s5loader"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    here = name.split(".") if is_pkg else name.split(".")[:-1]
                    here = here[: len(here) - (child.level - 1)]
                    base = ".".join(here + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                if base.startswith("s5loader"):
                    for a in child.names:
                        full = f"{base}.{a.name}"
                        found.append((full if full in modules else target(base), inner))
            visit(child, inner)

    visit(_parse(path.read_text()), False)
    return [(t, lazy) for t, lazy in found if t != name]


def _graph() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    lazy: set[tuple[str, str]] = set()
    for name, path in modules.items():
        for target, is_lazy in _imports(name, path, modules):
            graph[name].add(target)
            if is_lazy:
                lazy.add((name, target))
    return graph, lazy


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            connect(v)
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package() -> None:
    graph, _ = _graph()
    # a package imports its own modules to export them; its modules must not import it back
    assert _cycles(graph) == []


def test_imports_are_at_the_top_but_the_deliberate_lazy_ones() -> None:
    _, lazy = _graph()
    # the CLI imports each command's module when that command runs (s5loader.cli._load)
    unexpected = sorted(e for e in lazy - LAZY_ALLOWED if e[0] != "s5loader.cli")
    assert unexpected == []


def test_no_module_over_400_lines_and_no_class_over_300() -> None:
    long_modules, long_classes = [], []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > MODULE_LINES:
            long_modules.append((name, text.count("\n")))
        for node in ast.walk(_parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > CLASS_LINES:
                    long_classes.append((f"{name}.{node.name}", size))
    assert long_modules == [] and long_classes == []


def test_the_architecture_doc_names_every_module() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path in _modules().values():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in doc and path.name != "__init__.py":
            missing.append(rel)
    assert missing == []


# The rows of docs/architecture.md's "front ends, counted": what sits between Staging and each
# front end's hand-off; the adapters (the last three but the feed) must stay within ADAPTER_LINES.
FRONT_ENDS = {
    "the shared object": [
        "_sampling/staging",
        "_sampling/run",
        "_sampling/epochs",
        "_sampling/setup",
        "_sampling/passes",
    ],
    "`S5Sampler`": ["sampler", "_sampling/early"],
    "`S5IterableDataset`": ["iterable", "_sampling/rankhost"],
    "`s5loader prefetch`": ["_daemon/stream", "_daemon/delivery"],
    "the one channel": ["_util/frames", "_sampling/feed", "_sampling/wire", "_staging/words"],
}
ADAPTERS = ("`S5Sampler`", "`S5IterableDataset`", "`s5loader prefetch`")
# what else is each front end's own (the table's last column, "(N lines: ...")
OWN = {
    "`S5IterableDataset`": ["_sampling/iterparts", "_sampling/iterchecks", "_sampling/iterrest"],
    "`s5loader prefetch`": [
        *(f"_daemon/{p.stem}" for p in sorted((PACKAGE / "_daemon").glob("*.py")) if p.stem != "__init__"),
        "_daemon/__init__",
        "handover",
        "consume",
        "prefetch",
    ],
}
ADAPTER_LINES = 400


def code_lines(path: Path) -> int:
    """Lines that hold code: no docstring, comment or blank line."""
    import io
    import tokenize

    text = path.read_text()
    docs: set[int] = set()
    for node in ast.walk(_parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
                docs.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skip = (
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    )
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(lines)


def test_the_front_ends_are_adapters_of_at_most_400_lines_as_the_architecture_doc_counts_them() -> None:
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc.split("<!-- front-end-lines -->")[1].split("<!-- /front-end-lines -->")[0]
    rows = [row.split("|") for row in table.strip().splitlines()[2:]]
    said = {cells[1].strip(): int(cells[3].replace(",", "")) for cells in rows}
    counts = {
        name: sum(code_lines(PACKAGE / f"{m}.py") for m in modules) for name, modules in FRONT_ENDS.items()
    }
    for name in ADAPTERS:
        assert counts[name] <= ADAPTER_LINES, f"{name}'s adapter has {counts[name]} lines of code"
    for name, modules in OWN.items():
        mine = [m for m in modules if m not in FRONT_ENDS[name]]
        counts[f"{name}, the rest"] = sum(code_lines(PACKAGE / f"{m}.py") for m in mine)
        rest = re.search(r"\(([\d,]+) lines", next(c[4] for c in rows if c[1].strip() == name))
        assert rest is not None, f"the architecture doc gives no count of what else is {name}'s"
        said[f"{name}, the rest"] = int(rest.group(1).replace(",", ""))
    wrong = {n: (said.get(n), c) for n, c in counts.items() if said.get(n) != round(c, -1)}
    assert wrong == {}, f"docs/architecture.md says (lines, counted now): {wrong}"
    assert re.search(r"\| a plain generator \|", table)


def test_the_unit_tier_refuses_subprocesses_and_sockets() -> None:
    import socket
    import subprocess

    from support.tiers import TierError

    for attempt in (lambda: subprocess.run(["true"]), lambda: socket.create_connection(("127.0.0.1", 9))):
        try:
            attempt()
        except TierError:
            continue
        raise AssertionError("the unit tier let a subprocess or a connection through")


def test_links_between_the_readme_and_the_docs_resolve() -> None:
    import re

    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in re.finditer(r"\]\(([^)#:]*)(#[^)]+)?\)", text):
            target = (doc.parent / m.group(1)).resolve() if m.group(1) else doc
            if not target.exists():
                bad.append(f"{doc.name}: {m.group(0)}")
            elif m.group(2) and target.suffix == ".md":
                heads = re.findall(r"^#+ (.*)$", target.read_text(), re.M)
                anchors = {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in heads}
                if m.group(2)[1:] not in anchors:
                    bad.append(f"{doc.name}: {m.group(0)}")
    assert bad == []


def test_the_readme_is_read_in_ten_minutes() -> None:
    assert (ROOT / "README.md").read_text().count("\n") <= 400
