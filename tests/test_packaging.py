"""Identity, first contact and the installed package (issues 15 and 25), all **real**: the
distribution name, licence and metadata of the installed package, install hints, the shipped
traces, that ``import gpumem`` loads no framework, that every public method says what it does,
and (where gpumem is installed from a wheel, as ci/package.sh runs these tests) that the
installed distribution holds every part a user or a downstream build relies on.

Parts that read the source checkout (pyproject.toml, docs, README, ci/) skip outside one."""
from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import gpumem
from invariants import DATA, require_checkout

PKG = Path(gpumem.__file__).resolve().parent
DIST = "gpumem-pool"
#: the real PyTorch traces gpumem ships (gpumem/data/traces)
TRACES = {"gpt2_train", "resnet50_train", "gpt2_generate", "bert_varlen_infer"}
WRONG_HINT = re.compile(r"pip install (\")?gpumem(\[|\s|$)")


def _wrong_hints(files: list[Path], root: Path) -> list[str]:
    return [f"{f.relative_to(root)}:{i}" for f in files
            for i, line in enumerate(f.read_text().splitlines(), 1) if WRONG_HINT.search(line)]


def test_distribution_name_licence_and_metadata():
    """The installed distribution is gpumem-pool (gpumem on PyPI is someone else's), under
    Apache-2.0 with the LICENSE file installed beside its metadata, its version is
    gpumem.__version__, and the import name stays gpumem."""
    meta = metadata.metadata(DIST)
    assert meta["Name"] == DIST
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    assert any(c.startswith("Programming Language :: Python :: 3")
               for c in meta.get_all("Classifier"))
    assert not meta.get_all("Project-URL")          # left out rather than invented
    text = metadata.distribution(DIST).read_text("licenses/LICENSE")
    assert text is not None and "Apache License" in text
    assert "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert metadata.version(DIST) == gpumem.__version__


def test_pyproject_names_the_distribution_and_reads_the_version_from_one_place():
    """pyproject.toml: the name, the licence, and a version that is not written there but read
    from gpumem.__version__ (one place to change it)."""
    root = require_checkout("pyproject.toml")
    # tomllib is 3.11+; gpumem supports 3.10, where this module must still import
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["name"] == DIST and project["license"] == "Apache-2.0"
    assert "version" not in project and project["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gpumem.__version__"}


def test_no_install_hint_in_the_package_names_the_wrong_distribution():
    """No message in gpumem (its .py and .pyx sources, installed or checked out) tells users to
    `pip install gpumem[...]`, which would install the unrelated package; the CUDA hint says
    gpumem-pool."""
    files = [*PKG.glob("**/*.py"), *PKG.glob("**/*.pyx")]
    assert len(files) > 50
    assert _wrong_hints(files, PKG) == []
    from gpumem.backends.cuda import _INSTALL_HINT
    assert "pip install gpumem-pool[cuda]" in _INSTALL_HINT


def test_no_install_hint_in_the_docs_names_the_wrong_distribution():
    """The same for README, docs and the CI scripts of the checkout."""
    root = require_checkout("README.md, docs/ and ci/")
    files = [*root.glob("docs/*.md"), root / "README.md", *root.glob("ci/*.sh")]
    assert _wrong_hints(files, root) == []


def test_the_four_traces_ship_with_gpumem():
    """The commands of the README need no ../shared: the four traces, each with its metadata,
    and their README are in gpumem's data folder (installed or checked out)."""
    d = DATA / "traces"
    assert {p.name[:-len(".csv.gz")] for p in d.glob("*.csv.gz")} == TRACES
    assert all((d / f"{n}.json").is_file() for n in TRACES) and (d / "README.md").is_file()


def test_nothing_points_at_the_shared_traces_folder():
    """No doc, test, benchmark or module of the checkout points at ../shared/traces."""
    root = require_checkout("README.md, docs/ and asv_benchmarks/")
    files = [root / "README.md", *root.glob("docs/*.md"), *root.glob("tests/**/*.py"),
             *root.glob("asv_benchmarks/**/*.py"), *root.glob("gpumem/**/*.py")]
    assert [f.name for f in files if "shared/traces" in f.read_text()
            and f.name != "test_packaging.py"] == []


def test_import_gpumem_loads_no_framework():
    """`import gpumem` (with the PyTorch bridge and training estimates reachable) imports no
    framework: torch, pyopencl, cupy, numba, distributed stay unloaded."""
    code = ("import sys, gpumem; gpumem.export_memory_viz; gpumem.estimate_training_memory; "
            "print(sorted(m for m in ('torch', 'pyopencl', 'cupy', 'numba', 'distributed', "
            "'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PKG.parent).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("cls", [gpumem.MemoryManager, gpumem.MemoryConfig,
                                 gpumem.FallbackBuffer, gpumem.MemoryEstimate])
def test_every_public_method_has_a_docstring(cls):
    """stats, pressure, reset_peak_stats, remove_observer... every public method or property
    of the main classes says what it does."""
    missing = []
    for name, obj in inspect.getmembers(cls):
        if name.startswith("_") or not (callable(obj) or isinstance(obj, property)):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(name)
    assert missing == []


# --- the installed distribution (issue 25). Level: real (the files pip installed) ----------------

def _installed_files() -> dict[str, Path]:
    """The installed distribution's files (RECORD), by their path relative to site-packages;
    skip where gpumem is not an ordinary install (editable, or a checkout on sys.path)."""
    dist = metadata.distribution(DIST)
    direct = dist.read_text("direct_url.json")
    if direct and json.loads(direct).get("dir_info", {}).get("editable"):
        pytest.skip("gpumem-pool is an editable install: its file list is the checkout's .pth")
    if Path(dist.locate_file("gpumem/__init__.py")).resolve() != PKG / "__init__.py":
        pytest.skip(f"gpumem is imported from {PKG}, not from the installed distribution")
    return {str(f): Path(dist.locate_file(f)) for f in dist.files or ()}


def _compiled_modules(files: dict[str, Path]) -> dict[str, str]:
    """Module name -> installed path without suffix, for each compiled gpumem module."""
    found = {}
    for name in files:
        if name.startswith("gpumem/") and name.endswith(".so"):
            stem = name.split(".", 1)[0]                 # gpumem/_core/pool.cpython-311-... -> pool
            found[stem.replace("/", ".")] = stem
    return found


def test_installed_files_are_all_there():
    """Every file the wheel's RECORD lists is on disk, and gpumem runs from them."""
    files = _installed_files()
    assert [n for n, p in files.items() if not p.exists()] == []
    assert files["gpumem/__init__.py"].resolve() == PKG / "__init__.py"


def test_installed_distribution_is_typed_and_has_its_stubs():
    """py.typed is installed, and every compiled module that defines a public class or function
    has its .pyi stub beside it (type checkers see the Cython API)."""
    files = _installed_files()
    assert "gpumem/py.typed" in files
    compiled = _compiled_modules(files)
    assert {"gpumem._core.pool", "gpumem._core.buffer", "gpumem._core.view"} <= set(compiled)
    missing = []
    for modname, stem in compiled.items():
        module = importlib.import_module(modname)
        public = [n for n, obj in vars(module).items() if not n.startswith("_")
                  and getattr(obj, "__module__", None) == modname
                  and (inspect.isclass(obj) or callable(obj))]
        if public and f"{stem}.pyi" not in files:
            missing.append(f"{stem}.pyi ({', '.join(public)})")
    assert missing == []


#: `from gpumem.x cimport names` (group 1, group 2 the names) or `cimport gpumem.x` (group 3)
_CIMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(gpumem[\w.]*)[ \t]+cimport[ \t]+\(?([\w, \t]*)"
                      r"|cimport[ \t]+(gpumem[\w.]*))", re.M)


def _cimported_pxds(text: str) -> list[list[str]]:
    """For each cimport of a gpumem module in ``text``, the .pxd files that could satisfy it:
    ``from gpumem._core cimport pool_history`` is the package's pool_history.pxd (a module),
    ``from gpumem._core.pool cimport gm_alloc`` is pool.pxd."""
    out = []
    for m in _CIMPORT.finditer(text):
        if m.group(3):
            out.append([m.group(3).replace(".", "/") + ".pxd"])
            continue
        base = m.group(1).replace(".", "/")
        names = [n.strip() for n in m.group(2).split(",") if n.strip()]
        # each name is declared in base.pxd or is a module base/<name>.pxd of a package; names
        # in parentheses on the next lines are not parsed: then base.pxd itself must be there
        out += [[f"{base}.pxd", f"{base}/{n}.pxd"] for n in names] or [[f"{base}.pxd"]]
    return out


def test_installed_distribution_has_the_cython_api():
    """gpumem/_core/pool.pxd is installed, every gpumem module that an installed .pxd or .pyx
    cimports has its .pxd installed too (so a downstream `cimport gpumem._core.pool` resolves),
    and each compiled module's .pyx ships (Cython tracebacks show its lines)."""
    files = _installed_files()
    assert "gpumem/_core/pool.pxd" in files
    unresolved = []
    for name, path in files.items():
        if name.startswith("gpumem/") and name.endswith((".pxd", ".pyx")):
            for choices in _cimported_pxds(path.read_text()):
                if not any(c in files for c in choices):
                    unresolved.append(f"{name} cimports {' or '.join(choices)}")
    assert unresolved == []
    assert [s for s in _compiled_modules(files).values() if f"{s}.pyx" not in files] == []


def test_installed_distribution_has_its_data():
    """The files gpumem's code reads are installed: the model presets, the demo trace, and the
    four shipped traces with their metadata and README."""
    from gpumem.cli import DEMO_TRACE
    from gpumem.planning.estimate import PRESETS_FILE
    files = _installed_files()
    site = PKG.parent
    for used in (PRESETS_FILE, DEMO_TRACE):
        assert str(Path(used).resolve().relative_to(site)) in files
    for n in TRACES:
        assert {f"gpumem/data/traces/{n}.csv.gz", f"gpumem/data/traces/{n}.json"} <= set(files)
    assert "gpumem/data/traces/README.md" in files


def test_installed_entry_points_work(pytestconfig):
    """The `gpumem` console script is installed and runs; the pytest11 entry point names
    gpumem.testing.plugin, and pytest loaded it in this very session from the installed
    distribution."""
    files = _installed_files()
    dist = metadata.distribution(DIST)
    (script,) = [ep for ep in dist.entry_points if ep.group == "console_scripts"]
    assert (script.name, script.value) == ("gpumem", "gpumem.cli:main")
    (exe,) = [p for n, p in files.items() if n.endswith("bin/gpumem")]
    done = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"gpumem {gpumem.__version__}"
    (plugin,) = [ep for ep in dist.entry_points if ep.group == "pytest11"]
    assert (plugin.name, plugin.value) == ("gpumem", "gpumem.testing.plugin")
    loaded = pytestconfig.pluginmanager.get_plugin("gpumem")
    assert loaded is not None and loaded is importlib.import_module("gpumem.testing.plugin")


# --- wheels for glibc 2.28 (issue 34). Level: real (zig's flags, ELF files of this machine) -----

def test_installed_wheel_is_tagged_for_glibc_2_28_or_older():
    """A gpumem installed from a wheel (ci/package.sh runs the suite so) carries only
    manylinux tags of glibc 2.28 or older: pip installs it on RHEL 8 and its rebuilds,
    Ubuntu 20.04, Debian 10 and newer. Skips for an editable install or a checkout."""
    _installed_files()
    text = metadata.distribution(DIST).read_text("WHEEL") or ""
    platforms = [tag.rsplit("-", 1)[-1] for tag in re.findall(r"^Tag: (\S+)$", text, re.M)]
    assert platforms, f"no Tag line in the installed WHEEL file:\n{text}"
    # manylinux2014 is the legacy name of manylinux_2_17
    found = [re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64",
                          "manylinux_2_17_x86_64" if p == "manylinux2014_x86_64" else p)
             for p in platforms]
    assert all(found), f"not a manylinux tag: {platforms}"
    assert max((int(m[1]), int(m[2])) for m in found) <= (2, 28), platforms


def test_zig_compiler_wrapper_maps_the_flags_zig_refuses():
    """ci/zig_cc.sh (the wheels' CC/CXX): every call targets glibc 2.28; the GCC spellings that
    stop zig's clang driver (-flto=auto, -Wl,-Bsymbolic-functions from Debian's Python,
    -mtune=generic, -march=x86-64-v2) are mapped or dropped, other flags pass unchanged, and
    a -target of the caller's is refused rather than silently overriding the glibc target."""
    root = require_checkout("ci/zig_cc.sh")
    env = {"PATH": "/usr/bin:/bin", "ZIG": "/bin/echo"}     # zig stood in by echo: argv back

    def wrap(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(root / "ci" / "zig_cc.sh"), *args], env=env,
                              capture_output=True, text=True, timeout=30)
    done = wrap("c++", "-O3", "-flto=auto", "-Wl,-Bsymbolic-functions", "-mtune=generic",
                "-march=x86-64-v2", "-Wl,-rpath,/opt/py/lib", "-c", "a.cpp", "-o", "a.o")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["c++", "-target", "x86_64-linux-gnu.2.28", "-O3", "-flto",
                                   "-march=x86_64_v2", "-Wl,-rpath,/opt/py/lib", "-c", "a.cpp",
                                   "-o", "a.o"]
    assert wrap("cc", "-shared", "x.o").stdout.split()[:3] == ["cc", "-target",
                                                                "x86_64-linux-gnu.2.28"]
    refused = wrap("cc", "-target", "x86_64-linux-gnu.2.36", "-c", "a.c")
    assert refused.returncode == 2 and "-target" in refused.stderr
    assert wrap("ld", "a.o").returncode == 2


def test_symbol_check_names_an_import_newer_than_glibc_2_28(tmp_path):
    """ci/wheel_symbols.py (ci/package.sh's check on every wheel) fails on a shared object
    compiled against this machine's glibc that imports dlopen@GLIBC_2.34 and stat@GLIBC_2.33,
    naming each symbol, in a wheel as well as given directly; a wheel with no such import
    passes. Needs pyelftools, a C compiler and glibc >= 2.34 here."""
    import platform
    import shutil
    import zipfile
    root = require_checkout("ci/wheel_symbols.py")
    pytest.importorskip("elftools", reason="pyelftools (the test extra) is not installed")
    libc, version = platform.libc_ver()
    if libc != "glibc" or tuple(map(int, version.split(".")[:2])) < (2, 34):
        pytest.skip(f"this machine's C library ({libc} {version}) predates GLIBC_2.34's dlopen")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler here")
    (tmp_path / "new.c").write_text(
        "#include <dlfcn.h>\n#include <sys/stat.h>\n"
        "int f(const char *p) { struct stat s; return stat(p, &s) + (dlopen(p, 0) != 0); }\n")
    subprocess.run([cc, "-shared", "-fPIC", "new.c", "-o", "new.so"], cwd=tmp_path, check=True)
    bad = tmp_path / "bad-0.1-cp311-cp311-linux_x86_64.whl"
    good = tmp_path / "good-0.1-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as whl:
        whl.write(tmp_path / "new.so", "pkg/new.cpython-311-x86_64-linux-gnu.so")
    with zipfile.ZipFile(good, "w") as whl:
        whl.writestr("pkg/__init__.py", "")
    check = [sys.executable, str(root / "ci" / "wheel_symbols.py")]
    for target in (tmp_path / "new.so", bad):
        done = subprocess.run([*check, str(target)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "dlopen@GLIBC_2.34" in done.stderr and "stat@GLIBC_2.33" in done.stderr
    done = subprocess.run([*check, str(good)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "0 shared objects" in done.stdout, done.stderr
