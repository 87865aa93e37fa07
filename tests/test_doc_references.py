"""What the documentation quotes exists, and no file cites this project's own issue numbers.

References. Every backquoted token that looks like a reference must name something that exists:
in the docstrings of ``tpo_kernels/`` (module, class and function docstrings, read with ``ast``:
````x````, ```x``` and Sphinx roles such as ``:class:`~tpo_kernels.ops.tiles.TilePolicy```), in
its comments, and in DESIGN.md, the README and the trainer guides (```x``` outside code blocks);
paths written without quotes (``csrc/cpu/parallel.h``) count too. A reference is

* a path: no whitespace, a ``/`` in it, and a source or document extension (``ops/tiles.py``,
  ``csrc/row_math.h``), a trailing ``/`` (``checks/``), or a first part that is a folder of the
  tree (``csrc/cuda``); a bare file name (``tpo_abi.h``) counts too. Resolved against the
  repository root, ``tpo_kernels/``, ``csrc/`` and the docstring's own folder; a bare name
  anywhere in the tree;
* a dotted Python name whose first part is a module of the package or of the tree's ``bench``
  (``ops.tiles.TilePolicy``, ``tpo_kernels.distributed.VocabShard``, ``group_math.pair_runs``)
  or a name the package defines (``RowSummary.merge``); the module after ``python -m``;
* in a docstring, the target of a Sphinx role, dotted or not (``:class:`Plan```, ``:mod:`.agreement```).

Names are resolved statically from the sources (nothing is imported): modules, their top-level
names (an import is followed to its source), and class members (methods, fields, attributes set
on ``self``, those of base classes in the package). A name whose first part is another library
(one the sources import: ``torch``, ``trl``, ...) or an argument of the documented function is
not checked. Every unresolved reference is reported at once, and every link of those documents to
a section (``DESIGN.md#numerics``) must find its heading.

Issue numbers. No file of the repository (code, documents, recorded results) cites this
project's tracker by number ("issue N", "issueN-cpu"): it says what the code does and why. A
reference to another project's issue or pull request ("TRL #5699", "vLLM issue 123") stays.
"""

from __future__ import annotations

import ast
import builtins
import io
import pathlib
import re
import functools
import subprocess
import tokenize
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tpo_kernels"
DESIGN = ROOT / "DESIGN.md"
# The documents held to the same rule: the design, the README and the trainer guides beside their code.
DOCUMENTS = (DESIGN, ROOT / "README.md", PACKAGE / "integrations" / "trl" / "README.md",
             PACKAGE / "integrations" / "verl" / "README.md")
# Python packages of the tree whose names documents quote: the package and the clone's experiments.
SOURCE_PACKAGES = ("tpo_kernels", "bench")
PATH_SUFFIXES = (".py", ".h", ".cuh", ".cu", ".cpp", ".inl", ".md", ".sh", ".txt", ".json", ".toml", ".in")
PATH_BASES = (ROOT, PACKAGE, ROOT / "csrc")


# ----------------------------------------------------------------------------- the static index

@dataclass
class ClassInfo:
    members: Set[str]
    bases: List[str]  # base class names as written (resolved in the class's module)
    nested: Dict[str, "ClassInfo"] = field(default_factory=dict)


@dataclass
class ModuleInfo:
    name: str
    path: pathlib.Path
    classes: Dict[str, ClassInfo] = field(default_factory=dict)
    values: Set[str] = field(default_factory=set)  # functions and assigned names
    imports: Dict[str, str] = field(default_factory=dict)  # local name -> absolute dotted target


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _target_names(target: ast.AST) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _target_names(element)


def _class_info(node: ast.ClassDef) -> ClassInfo:
    info = ClassInfo(members=set(), bases=[ast.unparse(base) for base in node.bases])
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info.members.add(item.name)
        elif isinstance(item, ast.ClassDef):
            info.members.add(item.name)
            info.nested[item.name] = _class_info(item)
        elif isinstance(item, ast.AnnAssign):
            info.members.update(_target_names(item.target))
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                info.members.update(_target_names(target))
    for sub in ast.walk(node):  # attributes a method sets on self
        if isinstance(sub, (ast.Assign, ast.AnnAssign)):
            for target in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    info.members.add(target.attr)
    return info


def _lazy_exports(value: Optional[ast.AST], package: str) -> Dict[str, str]:
    """The names a module exports on first access (PEP 562), kept as a literal dict ``{name:
    (".module", attribute or None)}`` as ``tpo_kernels/__init__.py`` keeps them."""
    if not isinstance(value, ast.Dict):
        return {}
    exports = {}
    for key, item in zip(value.keys, value.values):
        try:
            name, (module, attribute) = ast.literal_eval(key), ast.literal_eval(item)
        except (ValueError, TypeError):
            return {}
        if not (isinstance(name, str) and isinstance(module, str) and module.startswith(".")):
            return {}
        exports[name] = package + module + (f".{attribute}" if attribute else "")
    return exports


def _module_info(path: pathlib.Path, tree: ast.Module) -> ModuleInfo:
    name = _module_name(path)
    info = ModuleInfo(name=name, path=path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):  # top-level and conditional definitions alike (try/except imports)
        if isinstance(node, ast.ClassDef) and node in tree.body:
            info.classes[node.name] = _class_info(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in tree.body:
            info.values.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node in tree.body:
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                info.values.update(_target_names(target))
            info.imports.update(_lazy_exports(node.value, package))
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                info.imports[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                info.imports[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or \
                    alias.name.split(".")[0]
    return info


def _sources() -> List[pathlib.Path]:
    return sorted(path for package in SOURCE_PACKAGES for path in (ROOT / package).rglob("*.py")
                  if "__pycache__" not in path.parts)


@dataclass
class Index:
    modules: Dict[str, ModuleInfo]
    trees: Dict[pathlib.Path, ast.Module]
    externals: Set[str]  # top-level modules the sources import from elsewhere (torch, trl, ...)

    @classmethod
    @functools.lru_cache(maxsize=1)
    def build(cls) -> "Index":
        trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in _sources()}
        modules = {info.name: info for info in (_module_info(path, tree) for path, tree in trees.items())}
        setup = ROOT / "setup.py"  # compiled extensions exist once built: their names come from setup.py
        for name in re.findall(r"Extension\(\s*[\"']([\w.]+)[\"']", setup.read_text() if setup.is_file() else ""):
            modules.setdefault(name, ModuleInfo(name=name, path=ROOT / (name.replace(".", "/") + ".so")))
        externals = {alias.name.split(".")[0] for tree in trees.values() for node in ast.walk(tree)
                     for alias in (node.names if isinstance(node, ast.Import) else [])}
        externals |= {node.module.split(".")[0] for tree in trees.values() for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module}
        return cls(modules, trees, externals - set(SOURCE_PACKAGES))

    # ------------------------------------------------------------------ what counts as a reference

    def module_parts(self) -> Set[str]:
        return {part for name in self.modules for part in name.split(".")}

    def defined_names(self) -> Set[str]:
        return {name for info in self.modules.values() for name in (*info.classes, *info.values)}

    # ------------------------------------------------------------------ resolution

    def _class_has(self, module: ModuleInfo, info: ClassInfo, member: str, depth: int = 0) -> Optional[object]:
        if member in info.nested:
            return (module, info.nested[member])
        if member in info.members:
            return "value"
        for base in info.bases if depth < 8 else []:
            found = self._walk_from(module, base.split("."), depth + 1)
            if isinstance(found, tuple) and isinstance(found[1], ClassInfo):
                hit = self._class_has(found[0], found[1], member, depth + 1)
                if hit is not None:
                    return hit
        return None

    def _attribute(self, state, part: str, depth: int):
        """The state after ``.part``: a ModuleInfo, a (module, ClassInfo), "value" (a function or
        a value: further parts are not checked), "external", or None (does not exist)."""
        if state in ("value", "external"):
            return state
        if isinstance(state, tuple):
            return self._class_has(state[0], state[1], part, depth)
        module = state
        if f"{module.name}.{part}" in self.modules:
            return self.modules[f"{module.name}.{part}"]
        if part in module.classes:
            return (module, module.classes[part])
        if part in module.values:
            return "value"
        if part in module.imports:
            return self._absolute(module.imports[part], depth + 1)
        return None

    def _absolute(self, dotted: str, depth: int):
        parts = dotted.split(".")
        if parts[0] not in SOURCE_PACKAGES:
            return "external"
        if depth > 16:
            return None
        return self._walk(self.modules.get(parts[0]), parts[1:], depth)

    def _walk(self, state, parts: List[str], depth: int):
        for part in parts:
            if state is None:
                return None
            state = self._attribute(state, part, depth)
        return state

    def _walk_from(self, module: ModuleInfo, parts: List[str], depth: int = 0):
        """``parts`` read as a name of ``module``'s own namespace."""
        first = self._attribute(module, parts[0], depth)
        if first is None and f"{module.name.rpartition('.')[0]}.{parts[0]}" in self.modules:
            first = self.modules[f"{module.name.rpartition('.')[0]}.{parts[0]}"]
        return self._walk(first, parts[1:], depth)

    def resolves(self, name: str, context: Optional[ModuleInfo], owner: Optional[ClassInfo] = None) -> bool:
        if name.startswith("."):  # relative to the context module's package
            if context is None:
                return False
            package = context.name if context.path.name == "__init__.py" else context.name.rpartition(".")[0]
            return self._absolute(package + name, 0) is not None
        parts = name.split(".")
        if hasattr(builtins, parts[0]) and len(parts) == 1:
            return True
        starts = []
        if owner is not None and context is not None:  # a member of the enclosing class
            starts.append(self._walk(self._class_has(context, owner, parts[0]), parts[1:], 0))
        if context is not None:
            starts.append(self._walk_from(context, parts))
        if parts[0] in SOURCE_PACKAGES:
            starts.append(self._absolute(name, 0))
        for module_name, module in self.modules.items():  # a module named by its trailing parts
            pieces = module_name.split(".")
            for k in range(1, len(parts) + 1):
                if pieces[-k:] == parts[:k]:
                    starts.append(self._walk(module, parts[k:], 0))
            if parts[0] in module.classes or parts[0] in module.values:  # a name the package defines
                starts.append(self._walk_from(module, parts))
        return any(state is not None for state in starts)


# ----------------------------------------------------------------------------- the quoted tokens

BACKQUOTED = re.compile(r"(?::(?P<role>[a-z]+(?::[a-z]+)?):)?(?P<ticks>`+)(?P<text>[^`]+?)(?P=ticks)")
DOTTED = re.compile(r"\.?[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass
class Docstring:
    where: str  # path:line
    text: str
    module: Optional[ModuleInfo]  # None: a document
    folder: Optional[pathlib.Path] = None  # where its relative paths start (besides the roots)
    owner: Optional[ClassInfo] = None  # the class the docstring belongs to (its own or a method's)
    parameters: Set[str] = field(default_factory=set)  # the documented function's (names, not references)


def _docstrings(index: Index) -> Iterator[Docstring]:
    """Every module, class and function docstring of the package, with what encloses it."""
    for path, tree in index.trees.items():
        if PACKAGE not in path.parents:
            continue
        module = index.modules[_module_name(path)]
        where = path.relative_to(ROOT).as_posix()

        def visit(node: ast.AST, owner: Optional[ClassInfo], parameters: Set[str]) -> Iterator[Docstring]:
            if isinstance(node, ast.ClassDef):
                owner = module.classes.get(node.name) or (owner.nested.get(node.name) if owner else None) \
                    or _class_info(node)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args
                parameters = parameters | {a.arg for a in (*arguments.posonlyargs, *arguments.args,
                                                           *arguments.kwonlyargs, arguments.vararg, arguments.kwarg) if a}
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=False)
                if text:
                    yield Docstring(f"{where}:{getattr(node, 'lineno', 1)}", text, module, path.parent, owner,
                                    parameters)
            for child in ast.iter_child_nodes(node):
                yield from visit(child, owner, parameters)

        yield from visit(tree, None, set())
        comments = [f"{token.start[0]}\t{token.string}" for token in
                    tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
                    if token.type == tokenize.COMMENT]
        if comments:
            yield Docstring(f"{where} (comments)", "\n".join(comments), module, path.parent)


def _markdown_spans(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


# A path written without quotes: folders, then a file with a source or document extension.
BARE_PATH = re.compile(r"(?<![\w/.~$<-])(?:[\w.-]+/)+[\w-]+(?:\.[\w-]+)*\.(?:py|h|cuh|cu|cpp|inl|md|sh|txt|toml)\b"
                       r"(?![\w/*])")


def _tokens(text: str) -> Iterator[Tuple[Optional[str], str]]:
    """(role or None, token) of every backquoted span (``python -m X`` gives X) and every path
    written without quotes."""
    for match in BARE_PATH.finditer(BACKQUOTED.sub(" ", text)):
        yield None, match.group(0)
    for match in BACKQUOTED.finditer(text):
        role, token = match.group("role"), match.group("text").strip()
        command = re.search(r"python3? -m\s+([\w.]+)", token)
        if command:
            yield None, command.group(1)
            continue
        if role:
            token = re.sub(r"^.*<(.+)>$", r"\1", token).lstrip("~!")
        yield role, re.sub(r"\(\)$", "", token)


def _is_path(token: str, folders: Set[str]) -> bool:
    if re.search(r"[\s*?<>{}\[\]|:,()=]", token) or token.startswith(("http", "-")):
        return False
    if "/" not in token:
        return token.endswith(PATH_SUFFIXES) and token.count(".") == 1 and not token.startswith(".")
    return token.endswith(PATH_SUFFIXES) or token.endswith("/") or token.split("/")[0] in folders


def _path_exists(token: str, here: Optional[pathlib.Path], names: Set[str]) -> bool:
    if "/" not in token:
        return token in names
    relative = token.rstrip("/")
    bases = (*PATH_BASES, *([here] if here is not None else []))
    return any((base / relative).exists() for base in bases)


def _repository_files() -> List[pathlib.Path]:
    """Every file of the repository (tracked or not, not ignored); the whole tree without git."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
        return [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [path for path in ROOT.rglob("*") if path.is_file() and ".git" not in path.parts
                and "__pycache__" not in path.parts]


def _tree_file_names() -> Set[str]:
    return {path.name for path in _repository_files()}


def _top_folders() -> Set[str]:
    return {path.name for base in PATH_BASES for path in base.iterdir() if path.is_dir()} - {"__pycache__"}


def unresolved_references() -> List[str]:
    index = Index.build()
    module_parts, defined = index.module_parts(), index.defined_names()
    folders, names = _top_folders(), _tree_file_names()
    sources = list(_docstrings(index))
    sources += [Docstring(document.relative_to(ROOT).as_posix(), _markdown_spans(document.read_text(encoding="utf-8")),
                          None, document.parent)
                for document in DOCUMENTS if document.is_file()]
    missing = []
    for source in sources:
        for role, token in _tokens(source.text):
            if _is_path(token, folders):
                if not _path_exists(token, source.folder, names) and token.split("/")[0] not in index.externals:
                    missing.append(f"{source.where}: path `{token}`")
                continue
            if not DOTTED.fullmatch(token):
                continue
            first = token.lstrip(".").split(".")[0]
            if first in index.externals or first in source.parameters | {"self", "cls", "ctx"}:
                continue  # another library's name, or an argument's attribute
            if role is not None and source.module is not None:
                is_reference = True  # a Sphinx role names something, dotted or not
            else:
                is_reference = "." in token and not token.startswith(".") and (first in module_parts
                                                                                 or first in defined)
            if is_reference and not index.resolves(token, source.module, source.owner):
                missing.append(f"{source.where}: name `{token}`")
    return missing


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_anchors() -> List[str]:
    """Links of the documents to a section (``[x](DESIGN.md#numerics)``, ``[x](#section)``) whose
    target document has no heading with that anchor."""
    broken = []
    for document in DOCUMENTS:
        if not document.is_file():
            continue
        for target, anchor in re.findall(r"\]\(([^)\s#]*)#([^)\s]+)\)", document.read_text(encoding="utf-8")):
            linked = (document.parent / target).resolve() if target else document
            if not linked.is_file() or linked.suffix != ".md":
                continue
            headings = re.findall(r"^#+ (.+)$", _markdown_spans(linked.read_text(encoding="utf-8")), re.M)
            if anchor not in {_slug(heading) for heading in headings}:
                broken.append(f"{document.relative_to(ROOT).as_posix()}: {target or '(itself)'}#{anchor}")
    return broken


def test_every_link_to_a_section_finds_its_heading():
    broken = broken_anchors()
    assert not broken, "links to sections that do not exist:\n" + "\n".join(broken)


def test_every_quoted_name_and_path_exists():
    missing = unresolved_references()
    assert not missing, f"{len(missing)} quoted names or paths do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("token, exists", [
    ("tpo_kernels.ops.tiles.TilePolicy", True),
    ("ops.tiles.TilePolicy", True),
    ("RowSummary.merge", True),
    ("RowSummary.has_label", True),  # a dataclass field
    ("tpo_kernels.distributed.VocabShard.merge", True),  # through the package's import
    ("bench.kernel_report.loops", True),
    ("RowSummary.merged", False),
    ("tpo_kernels.distributed.VocabShardSeam", False),
    ("ops.tiles.NoSuchPolicy", False),
])
def test_a_dotted_name_resolves_only_when_defined(token, exists):
    assert Index.build().resolves(token, None) is exists


@pytest.mark.parametrize("heading, anchor", [
    ("Distributed training: the contract and how it is kept",
     "distributed-training-the-contract-and-how-it-is-kept"),
    ("The sampler-trainer mismatch in TPO's terms", "the-sampler-trainer-mismatch-in-tpos-terms"),
    ("1. The math", "1-the-math"),
])
def test_a_heading_has_githubs_anchor(heading, anchor):
    assert _slug(heading) == anchor


@pytest.mark.parametrize("token, exists", [
    ("ops/tiles.py", True), ("checks/", True), ("csrc/row_math.h", True), ("tpo_abi.h", True),
    ("checks/tensors.py", False), ("csrc/cpu/row_kernels.cu", False),
])
def test_a_path_resolves_only_when_present(token, exists):
    assert _is_path(token, _top_folders())
    assert _path_exists(token, None, _tree_file_names()) is exists


# ----------------------------------------------------------------------------- issue numbers

# Projects whose issues and pull requests a document may cite by number.
OTHER_PROJECTS = (r"TRL|vLLM|verl|Megatron(?:-LM|-Core)?|prime-rl|SkyRL|NeMo(?:-RL)?|torchtitan|open-instruct|miles"
                  r"|slime|OpenRLHF|PyTorch|torch|Triton|Liger(?:-Kernel)?|transformers|DeepSpeed|CUTLASS|cuBLAS"
                  r"|flash-attention|[\w.-]+/[\w.-]+")
# "issue N", "issue #N", "issueN", "issue-N", "issues N and M" (N a number); not the verb ("an SM
# issues 128 instructions"): a plural counts only before "#" or a list of numbers.
OWN_ISSUE = re.compile(r"\bissue(?:[ _-]*#?\d+|s\s+#\d+|s\s+\d+(?:\s*(?:,|and|&)\s*#?\d+)+)", re.I)
CITED_ELSEWHERE = re.compile(rf"\b(?:{OTHER_PROJECTS})\s*(?:(?:issues?|PR|pull request|pull)\s*#?|#)\d+"
                             rf"|github\.com/\S+/(?:issues|pull)/\d+", re.I)


def own_issue_references(line: str) -> List[str]:
    """The citations of this project's issue numbers in ``line``: none when the line cites another
    project's issue or pull request by number (``TRL #5699``, ``vLLM issue 123``)."""
    if CITED_ELSEWHERE.search(line):
        return []
    return [match.group(0) for match in OWN_ISSUE.finditer(line)]


WORD = "issue"  # spelled apart so that this file does not cite what it looks for


@pytest.mark.parametrize("line, cited", [
    (f"the target of {WORD} 31 (at most 1.5x)", [f"{WORD} 31"]),
    (f"({WORD} #5)", [f"{WORD} #5"]),
    (f"--preset {WORD}4-cpu", [f"{WORD}4"]),
    (f"the {WORD}-21 comparison", [f"{WORD}-21"]),
    (f"{WORD.capitalize()}s 10 and 11", [f"{WORD.capitalize()}s 10 and 11"]),
    (f"an SM {WORD}s 128 thread instructions per cycle", []),
    (f"as TRL #5699 reports ({WORD} 5699)", []),
    (f"vLLM {WORD} 49577", []),
    (f"linkedin/Liger-Kernel PR #1298 (its {WORD} 1297)", []),
    (f"the {WORD}'s three spreads", []),
    (f"torch 2.13, {WORD} 7", [f"{WORD} 7"]),  # a version number is not a citation elsewhere
])
def test_own_issue_numbers_are_told_from_other_projects(line, cited):
    assert own_issue_references(line) == cited


def test_no_file_cites_this_projects_issue_numbers():
    found = []
    for path in _repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for number, line in enumerate(text.splitlines(), 1):
            for citation in own_issue_references(line):
                found.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {citation!r}")
    assert not found, (f"{len(found)} citations of this project's issue numbers (say what the code does "
                       f"and why instead):\n" + "\n".join(found))
