"""glibc keeps freed memory for reuse after ``keep_freed_memory`` (Linux; elsewhere a no-op)."""

import ctypes
import sys

import pytest

from meshlm.training.cpu_allocator import keep_freed_memory


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_large_blocks_come_from_the_heap_and_stay_after_free():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    assert keep_freed_memory() is True
    size = 64 << 20  # by default glibc would mmap this block and unmap it on free
    before = libc.mallinfo2()
    block = libc.malloc(size)
    allocated = libc.mallinfo2()
    libc.free(block)
    after = libc.mallinfo2()
    assert allocated.hblkhd == before.hblkhd  # not a separate mapping...
    assert allocated.arena - before.arena + before.fordblks >= size  # ...but heap (grown, or free before)
    assert after.arena == allocated.arena  # and the heap was not trimmed: the next step reuses it
