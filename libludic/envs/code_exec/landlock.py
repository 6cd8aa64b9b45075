"""Landlock confinement of the code sandbox's plain mode (``sandbox.py``,
``SubprocessSandbox``): the code may write only beneath its own directory (and to
``/dev/null``), and may not signal any process outside its own tree. Landlock (Linux 5.13 and later, when the LSM is
enabled) needs no privilege: the bootstrap (``seccomp.python_argv``) applies it to the
interpreter before the code runs, after ``no_new_privs``.

What it handles: every right that creates, removes, writes or truncates a file or directory
(``LANDLOCK_ACCESS_FS_*``: WRITE_FILE, REMOVE_DIR, REMOVE_FILE, MAKE_* ; REFER from ABI 2,
TRUNCATE from ABI 3); reads stay allowed (the interpreter reads its standard library). From
ABI 6 it also scopes signals and abstract unix sockets to the sandbox's own processes, so the
code cannot kill the service that runs it even when both run as the same uid. Every ABI
denies the domain ptrace access to processes outside it: as an unprivileged uid the code
cannot read ``/proc/<pid>/environ`` (or ``maps``, ``mem``) of the run's other processes of
that uid (a root process keeps that access; the sandbox never runs code as root). Where the
kernel has no Landlock the sandbox refuses to run (``sandbox.py``, Guarantees).
"""

from __future__ import annotations

import ctypes
import functools

# linux/landlock.h; the syscall numbers are the same on every architecture (asm-generic)
NR_CREATE_RULESET, NR_ADD_RULE, NR_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1

WRITE_PROBE = """import os
open("inside", "w").write("x")
outside = []
for d in ("/tmp", "/dev/shm"):
    p = os.path.join(d, "ludic-sbx-probe-%d" % os.getpid())
    try:
        open(p, "w").close()
        os.unlink(p)
        outside.append(d)
    except OSError:
        pass
print("confined" if not outside else "writable: " + " ".join(outside))
"""

# Runs in the child, cwd = the run's directory; ``libc``, ``os``, ``c`` (ctypes) and
# ``fail`` come from the bootstrap. Exit 125 (fail) when the kernel refuses.
BOOTSTRAP = """abi = libc.syscall(444, None, c.c_size_t(0), 1)
if abi < 1:
    fail("landlock unavailable, errno %d" % c.get_errno())
fs = 0x1FF2 | (0x2000 if abi >= 2 else 0) | (0x4000 if abi >= 3 else 0)
class R(c.Structure): _fields_ = [("fs", c.c_uint64), ("net", c.c_uint64), ("scoped", c.c_uint64)]
class B(c.Structure): _pack_ = 1; _fields_ = [("allowed", c.c_uint64), ("fd", c.c_int32)]
rattr = R(fs, 0, 0x3 if abi >= 6 else 0)
rs = libc.syscall(444, c.byref(rattr), c.c_size_t(8 if abi < 4 else 16 if abi < 6 else 24), 0)
if rs < 0:
    fail("landlock ruleset refused, errno %d" % c.get_errno())
for path, rights in ((os.getcwd(), fs), ("/dev/null", 0x2 | (0x4000 if abi >= 3 else 0))):
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    if libc.syscall(445, rs, 1, c.byref(B(rights, fd)), 0) != 0:
        fail("landlock rule for %s refused, errno %d" % (path, c.get_errno()))
    os.close(fd)
if libc.syscall(446, rs, 0) != 0:
    fail("landlock_restrict_self refused, errno %d" % c.get_errno())
os.close(rs)
del abi, fs, R, B, rattr, rs, path, rights, fd
"""


@functools.cache
def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (older kernel, LSM off)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        v = int(libc.syscall(NR_CREATE_RULESET, None, ctypes.c_size_t(0), CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(v, 0)
