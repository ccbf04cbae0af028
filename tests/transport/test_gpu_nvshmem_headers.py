"""The NVSHMEM constants and device-function prototypes odcfn's kernels use, read from the
headers the installed nvidia-nvshmem wheel ships, so the two can never drift.

The `gpu` extra (the README's test command installs it) pulls nvidia-nvshmem: a missing wheel
FAILS here, it does not skip. The headers declare most block-scope functions through macros
(``NVSHMEMI_PUTMEM_SIGNAL_NBI_SCOPE_DECL(block, _block, x)``), so a small macro expander
(parameters substituted, ``##`` pasted) runs before the prototypes are matched.
"""

from __future__ import annotations

import os
import re

import nvidia.nvshmem as pkg  # type: ignore[import-not-found]  # the gpu extra: a hard requirement
import pytest

from odcfn.transport.gpu import _nvshmem_device as dev


def _include_dir() -> str:
    for root in getattr(pkg, "__path__", []):
        inc = os.path.join(root, "include")
        if os.path.isdir(inc):
            return inc
    pytest.fail(f"no include/ directory under {list(pkg.__path__)}")


def _read_headers(inc: str) -> str:
    texts = []
    for d, _, files in os.walk(inc):
        for f in sorted(files):
            if f.endswith((".h", ".cuh")):
                with open(os.path.join(d, f), errors="replace") as fh:
                    texts.append(fh.read())
    text = "\n".join(texts)
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)  # comments out, continuations joined
    text = re.sub(r"//[^\n]*", "", text)
    return text.replace("\\\n", " ")


def _expand_macros(text: str) -> str:
    """The text plus one expansion of every function-like macro invoked at the start of a line
    (enough for the ``*_SCOPE_DECL(block, _block, x)`` declarations)."""
    macros = {}
    for m in re.finditer(r"^\s*#\s*define\s+(\w+)\(([^)]*)\)(.*)$", text, re.M):
        macros[m.group(1)] = ([p.strip() for p in m.group(2).split(",")], m.group(3))
    out = [re.sub(r"^\s*#[^\n]*", "", text, flags=re.M)]  # directives out: bodies only via expansion
    for m in re.finditer(r"^\s*(\w+)\(([^()]*)\)\s*;?\s*$", text, re.M):
        if m.group(1) not in macros:
            continue
        params, body = macros[m.group(1)]
        args = [a.strip() for a in m.group(2).split(",")]
        if len(args) != len(params):
            continue
        for p, a in zip(params, args):
            body = re.sub(rf"\b{re.escape(p)}\b", a, body)
        out.append(re.sub(r"\s*##\s*", "", body))
    return "\n".join(out)


def _norm(t: str) -> str:
    return " ".join(t.replace("*", " * ").split()).replace(" *", "*")


def _prototypes(text: str, name: str) -> set[tuple[str, tuple[str, ...]]]:
    found = set()
    pat = rf"((?:[A-Za-z_]\w*[\s*]+)+?){name}\s*\(([^()]*)\)\s*[;{{]"
    for m in re.finditer(pat, text):
        words = [w for w in m.group(1).split() if not w.startswith(("NVSHMEMI_", "__")) and w != "inline"]
        ret = _norm(" ".join(words))
        args = []
        for a in m.group(2).split(","):
            a = a.strip()
            if not a or a == "void":
                continue
            a = re.sub(r"\b\w+$", "", a).strip()  # drop the parameter's name
            args.append(_norm(a))
        found.add((ret, tuple(args)))
    return found


@pytest.fixture(scope="module")
def headers() -> str:
    return _expand_macros(_read_headers(_include_dir()))


def test_signal_operation_codes_match_nvshmem_common_transport_h():
    inc = _include_dir()
    with open(os.path.join(inc, "device_host_transport", "nvshmem_common_transport.h")) as f:
        text = f.read()
    enum = re.search(r"typedef\s+enum\s*\{([^}]*)\}\s*nvshmemx_signal_op_t", text)
    assert enum, "nvshmemx_signal_op_t not found"
    values = dict(re.findall(r"(NVSHMEM_SIGNAL_\w+)\s*=\s*(\d+)", enum.group(1)))
    assert int(values["NVSHMEM_SIGNAL_SET"]) == dev.NVSHMEM_SIGNAL_SET == dev.SIGNAL_SET.value
    assert int(values["NVSHMEM_SIGNAL_ADD"]) == dev.NVSHMEM_SIGNAL_ADD == dev.SIGNAL_ADD.value


@pytest.mark.parametrize("name", sorted(dev.DEVICE_FUNCTIONS))
def test_device_function_prototype_matches_the_header(headers, name):
    ret, args = dev.DEVICE_FUNCTIONS[name]
    found = _prototypes(headers, name)
    assert found, f"{name}: no declaration in the installed NVSHMEM headers"
    assert found == {(_norm(ret), tuple(_norm(a) for a in args))}, f"{name}: headers declare {found}"


def test_the_parser_sees_what_it_must():
    """The checks above are only as good as the parser: it must find a macro-made declaration
    and tell a wrong prototype from the right one."""
    text = _expand_macros(
        "#define D(S, SUF) __device__ void f##SUF(void *d, size_t n, int pe);\nD(block, _block)\n"
        "NVSHMEMI_HOSTDEVICE_PREFIX int g(uint64_t *sig, uint64_t v);\n"
    )
    assert _prototypes(text, "f_block") == {("void", ("void*", "size_t", "int"))}
    assert _prototypes(text, "g") == {("int", ("uint64_t*", "uint64_t"))}


def test_the_shim_calls_each_function_with_the_headers_types(headers):
    """The LLVM declaration in the shim is what the linker matches against NVSHMEM's bitcode:
    void result, pointers as ``ptr``, size_t/uint64_t as i64, int as i32 (nvptx64)."""
    llvm = {"void*": "ptr", "const void*": "ptr", "uint64_t*": "ptr", "size_t": "i64", "uint64_t": "i64",
            "int": "i32"}  # fmt: skip
    ir = dev.shim_ir()
    for name in dev.DEVICE_FUNCTIONS:
        ((ret, args),) = _prototypes(headers, name)
        assert ret == "void"
        assert f"declare void @{name}({', '.join(llvm[a] for a in args)})" in ir, name
        assert re.search(rf"call void @{name}\(", ir), name
        assert re.search(rf"define linkonce_odr i32 @odcfn_{name}\(", ir), name
    # the shim comes before NVSHMEM's bitcode: triton links each library "only needed"
    libs = dev.extern_libs(90)
    assert [n for n, _ in libs] == ["odcfn_nvshmem_shim", "libnvshmem_device"]
    with open(libs[0][1]) as f:
        assert f.read() == ir
