"""The seccomp socket filter of the code sandbox (``sandbox.py``): the BPF program that
refuses ``socket(2)`` and ``io_uring_setup(2)``, the probe that checks it holds, and the
bootstrap the interpreter runs before the code: ``no_new_privs``, then the Landlock
confinement (``landlock.py``) when asked, then the filter.

In both isolation modes the interpreter starts with a bootstrap (``python_argv``) that
installs the filter (``no_new_privs``, then ``socket_filter_code``) before it runs
``main.py``: ``socket(2)`` and ``io_uring_setup(2)`` fail with EPERM, so the code opens no
socket of any family. The namespace mode's empty network namespace alone leaves unix
sockets on the filesystem reachable (a host service listening on a world-writable path);
the plain mode has no namespace at all. ``socketpair(2)``, which reaches nothing, still
works (asyncio needs it). Where the filter is unknown (another architecture) or a probe run
shows it does not hold, the sandbox refuses to run (``sandbox.py``, Guarantees) unless
``network_isolated`` is allowed; then the code runs without the filter and ``describe()``
says the network is reachable.
"""

from __future__ import annotations

import errno
import functools
import platform

from libludic.envs.code_exec import landlock

# classic BPF over struct seccomp_data {int nr; u32 arch; ...} (linux/seccomp.h, filter.h)
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_SECCOMP_RET_KILL_PROCESS, _SECCOMP_RET_ERRNO, _SECCOMP_RET_ALLOW = 0x80000000, 0x50000, 0x7FFF0000
# machine -> (AUDIT_ARCH_*, __NR_socket, __NR_io_uring_setup, first number outside the ABI)
_SYSCALLS = {
    "x86_64": (0xC000003E, 41, 425, 0x40000000),  # from 0x40000000: the x32 ABI, refused
    "aarch64": (0xC00000B7, 198, 425, 0xFFFFFFFF),
}
NETWORK_PROBE = """import socket
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    print("open")
except PermissionError:
    print("blocked")
"""
# argv: [python, -I, -c, this, main.py]. PR_SET_NO_NEW_PRIVS = 38, PR_SET_SECCOMP = 22,
# SECCOMP_MODE_FILTER = 2; exit 125 (the sandbox's set-up failure) when the kernel refuses.
_PRELUDE = """import ctypes as c, os, sys
libc = c.CDLL(None, use_errno=True)
libc.prctl.argtypes = [c.c_int, c.c_ulong, c.c_ulong, c.c_ulong, c.c_ulong]
def fail(what):
    sys.stderr.write("ludic-sandbox: setup failed: %s\\n" % what)
    sys.exit(125)
if libc.prctl(38, 1, 0, 0, 0) != 0:
    fail("no_new_privs refused, errno %d" % c.get_errno())
"""
_SECCOMP = """class F(c.Structure): _fields_ = [("code", c.c_ushort), ("jt", c.c_ubyte), ("jf", c.c_ubyte), ("k", c.c_uint32)]
class P(c.Structure): _fields_ = [("len", c.c_ushort), ("filter", c.POINTER(F))]
code = {code!r}
prog = P(len(code), (F * len(code))(*(F(*i) for i in code)))
if libc.prctl(22, 2, c.addressof(prog), 0, 0) != 0:
    fail("seccomp filter refused, errno %d" % c.get_errno())
del F, P, code, prog
"""
_RUN = """del c, os, libc, fail
sys.argv = sys.argv[1:]
__import__("runpy").run_path(sys.argv[0], run_name="__main__")
"""


@functools.cache
def socket_filter_code() -> tuple[tuple[int, int, int, int], ...] | None:
    """The seccomp program (``(code, jt, jf, k)`` BPF instructions) that refuses sockets on
    the host's architecture, None where it has no syscall numbers for it:

        arch != the host's                -> kill the process (another ABI's numbers)
        nr >= the ABI's end (x86_64: x32) -> EPERM
        nr == socket or io_uring_setup    -> EPERM  (io_uring can open sockets too)
        anything else                     -> allow
    """
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        return None
    arch, nr_socket, nr_uring, abi_end = nums
    eperm = _SECCOMP_RET_ERRNO | errno.EPERM
    return (
        (_BPF_LD_W_ABS, 0, 0, 4),  # A = seccomp_data.arch
        (_BPF_JEQ_K, 1, 0, arch),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),
        (_BPF_LD_W_ABS, 0, 0, 0),  # A = seccomp_data.nr
        (_BPF_JGE_K, 2, 0, abi_end),
        (_BPF_JEQ_K, 1, 0, nr_socket),
        (_BPF_JEQ_K, 0, 1, nr_uring),
        (_BPF_RET_K, 0, 0, eperm),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
    )


def python_argv(
    python: str, main: str, block_network: bool, confine_writes: bool = False
) -> list[str]:
    """How the sandbox runs ``main``: ``python -I main``, through a bootstrap that first
    confines writes and signals (``landlock.BOOTSTRAP``) when ``confine_writes``, then
    installs the socket filter when ``block_network`` (module docstring)."""
    code = socket_filter_code() if block_network else None
    if code is None and not confine_writes:
        return [python, "-I", main]
    boot = _PRELUDE
    if confine_writes:
        boot += landlock.BOOTSTRAP
    if code is not None:
        boot += _SECCOMP.format(code=code)
    return [python, "-I", "-c", boot + _RUN, main]
