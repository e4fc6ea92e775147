"""Device memory whose physical pages can be given back and taken again at the same
virtual address: CUDA's virtual memory management (cuMemAddressReserve, cuMemCreate,
cuMemMap), called through the driver library with ctypes -- no extension to build.

A ``VmmBuffer`` reserves an address range once and maps physical memory into it; ``unmap``
returns the physical memory to the device (``torch.cuda.mem_get_info`` sees it free) and
keeps the addresses, ``map`` backs them again. Tensors that are views of the buffer keep
their addresses across the two, so CUDA graphs captured over them stay valid; their
contents do not survive (the caller copies what must).

    buf = VmmBuffer(nbytes, device_index)     # mapped
    weights = buf.tensor[:n].view(torch.bfloat16)
    buf.unmap(); ...; buf.map()               # same addresses, fresh (undefined) contents
"""

from __future__ import annotations

import ctypes
import threading

import torch

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_driver: ctypes.CDLL | None = None
_driver_lock = threading.Lock()


def _cuda() -> ctypes.CDLL:
    global _driver
    with _driver_lock:
        if _driver is None:
            lib = ctypes.CDLL("libcuda.so.1")
            u64, size_t = ctypes.c_uint64, ctypes.c_size_t
            for name, args in {
                "cuInit": [ctypes.c_uint],
                "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
                "cuMemGetAllocationGranularity": [
                    ctypes.POINTER(size_t), ctypes.POINTER(_AllocationProp), ctypes.c_int,
                ],
                "cuMemAddressReserve": [ctypes.POINTER(u64), size_t, size_t, u64, u64],
                "cuMemAddressFree": [u64, size_t],
                "cuMemCreate": [ctypes.POINTER(u64), size_t, ctypes.POINTER(_AllocationProp), u64],
                "cuMemRelease": [u64],
                "cuMemMap": [u64, size_t, size_t, u64, u64],
                "cuMemUnmap": [u64, size_t],
                "cuMemSetAccess": [u64, size_t, ctypes.POINTER(_AccessDesc), size_t],
            }.items():  # fmt: skip
                fn = getattr(lib, name)
                fn.argtypes = args
                fn.restype = ctypes.c_int
            _check(lib, lib.cuInit(0), "cuInit")
            _driver = lib
        return _driver


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(message))
        text = message.value.decode() if message.value else "unknown error"
        raise RuntimeError(f"{what} failed: CUDA error {result} ({text})")


class _ArrayInterface:
    """What torch.as_tensor reads to view device memory it does not own."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


class VmmBuffer:
    def __init__(self, nbytes: int, device_index: int) -> None:
        lib = _cuda()
        torch.cuda.set_device(device_index)  # a current (primary) context for the driver calls
        self.device_index = device_index
        self._prop = _AllocationProp()
        self._prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, device_index)
        granularity = ctypes.c_size_t()
        _check(
            lib,
            lib.cuMemGetAllocationGranularity(
                ctypes.byref(granularity), ctypes.byref(self._prop),
                _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            ),
            "cuMemGetAllocationGranularity",
        )  # fmt: skip
        step = granularity.value
        self.nbytes = max(step, -(-nbytes // step) * step)
        ptr = ctypes.c_uint64()
        _check(lib, lib.cuMemAddressReserve(ctypes.byref(ptr), self.nbytes, 0, 0, 0), "reserve")
        self.ptr = ptr.value
        self._handle: int | None = None
        self.map()
        self.tensor = torch.as_tensor(_ArrayInterface(self.ptr, self.nbytes), device="cuda")

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Back the addresses with fresh physical memory (contents undefined)."""
        if self._handle is not None:
            return
        lib = _cuda()
        handle = ctypes.c_uint64()
        _check(
            lib, lib.cuMemCreate(ctypes.byref(handle), self.nbytes, ctypes.byref(self._prop), 0),
            f"cuMemCreate of {self.nbytes / 2**30:.2f} GiB",
        )  # fmt: skip
        try:
            _check(lib, lib.cuMemMap(self.ptr, self.nbytes, 0, handle.value, 0), "cuMemMap")
            access = _AccessDesc(
                _Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.device_index),
                _CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            )
            _check(
                lib, lib.cuMemSetAccess(self.ptr, self.nbytes, ctypes.byref(access), 1),
                "cuMemSetAccess",
            )  # fmt: skip
        except BaseException:
            lib.cuMemUnmap(self.ptr, self.nbytes)
            lib.cuMemRelease(handle.value)
            raise
        self._handle = handle.value

    def unmap(self) -> None:
        """Give the physical memory back to the device; the addresses stay reserved. Every
        kernel reading the buffer must have finished (the caller synchronizes)."""
        if self._handle is None:
            return
        lib = _cuda()
        _check(lib, lib.cuMemUnmap(self.ptr, self.nbytes), "cuMemUnmap")
        _check(lib, lib.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None

    def close(self) -> None:
        self.unmap()
        _check(_cuda(), _cuda().cuMemAddressFree(self.ptr, self.nbytes), "cuMemAddressFree")
