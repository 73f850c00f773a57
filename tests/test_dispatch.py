"""The signature table (runtime/dispatch): the C++ table and its Python specification
pass the same cases. A ctypes callback stands in for a kernel library's kvf_launch."""
import ctypes
import struct
import sys

import pytest
import torch

from kvforge.runtime import dispatch
from kvforge.runtime.abi import Args

WORDS = ctypes.sizeof(Args) // 8


@pytest.fixture(scope="module")
def native():
    return dispatch.build_native()


@pytest.fixture(params=["native", "python"])
def table(request):
    t = request.getfixturevalue("native") if request.param == "native" else dispatch.PythonTable()
    t.clear()
    state = {"device": 0}
    t.configure(lambda: state["device"], lambda dev: 1000 + dev, 8)
    yield t, state
    t.clear()
    if dispatch._TABLE is t:  # the process's table (one C++ module): set up afresh when next needed
        dispatch._TABLE = None


class Kernel:
    """A fake kvf_launch: records (the packed Args as 64-bit words, stream), returns `code`."""

    def __init__(self, code=0):
        self.calls, self.code = [], code
        self.fn = dispatch._LAUNCH_FN(self._launch)
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value

    def _launch(self, args, stream):
        self.calls.append((struct.unpack(f"<{WORDS}Q", ctypes.string_at(args, WORDS * 8)), stream))
        return self.code


def call(**over):
    """An argument tuple like the op's: tensors, None, ints, a float, strings, a bool."""
    a = dict(qkv=torch.zeros(4, 8, dtype=torch.bfloat16), pos=torch.zeros(4, dtype=torch.int64),
             none=None, heads=8, eps=1e-6, contract="vllm_shuffle16", flag=False)
    a.update(over)
    return tuple(a.values())


TEMPLATE = struct.pack(f"<{WORDS}Q", *range(1, WORDS + 1))
SLOTS = ((0, 0), (3, 1))  # word 0 <- argument 0's pointer, word 3 <- argument 1's


def bind(t, argv, kernel, device=0, on_error=None):
    return t.bind(argv, TEMPLATE, SLOTS, kernel.address, device, on_error or (lambda code: None))


def test_a_bound_signature_launches_with_the_new_pointers(table):
    t, _ = table
    k = Kernel()
    assert bind(t, call(), k)
    fresh = call()
    assert t.launch(fresh)
    (words, stream), = k.calls
    expected = list(range(1, WORDS + 1))
    expected[0], expected[3] = fresh[0].data_ptr(), fresh[1].data_ptr()
    assert list(words) == expected and stream == 1000
    assert t.size() == 1


def test_every_property_validation_reads_is_in_the_signature(table):
    t, _ = table
    k = Kernel()
    bind(t, call(), k)
    q = torch.zeros(4, 8, dtype=torch.bfloat16)
    flat = torch.zeros(q.numel() + 8, dtype=q.dtype)
    changed = {
        "dtype": call(qkv=q.half()),
        "shape": call(qkv=torch.zeros(5, 8, dtype=torch.bfloat16)),
        "stride": call(qkv=torch.zeros(8, 4, dtype=torch.bfloat16).t()),
        "alignment": call(qkv=flat[1:1 + q.numel()].view(q.shape)),
        "a tensor for None": call(none=torch.zeros(1)),
        "int value": call(heads=4),
        "float for int": call(heads=8.0),
        "bool for int": call(heads=True),
        "float value": call(eps=1e-5),
        "string value": call(contract="sglang_nhd"),
        "bool value": call(flag=True),
        "int for bool": call(flag=0),
    }
    for what, argv in changed.items():
        assert not t.launch(argv), what
    assert not t.launch(call()[:-1]), "argument count"
    assert k.calls == []
    assert t.launch(call()) and len(k.calls) == 1


def test_arguments_only_validation_judges_are_never_launched(table):
    t, _ = table
    k = Kernel()
    bind(t, call(), k)
    for odd in ([1, 2], object(), torch.zeros(4, 8, dtype=torch.bfloat16, device="meta")):
        assert not t.launch(call(qkv=odd))
    for odd in ([1, 2], object()):  # (only validated calls are bound: never a meta tensor)
        assert not bind(t, call(qkv=odd), k)
    assert k.calls == []


def test_another_current_device_takes_the_full_path(table):
    t, state = table
    k = Kernel()
    bind(t, call(), k, device=1)
    assert not t.launch(call())
    state["device"] = 1
    assert t.launch(call())
    assert k.calls[0][1] == 1001


def test_a_launch_error_raises_through_the_library(table):
    t, _ = table
    k = Kernel(code=7)

    def on_error(code):
        raise RuntimeError(f"kernel failed to launch ({code})")

    bind(t, call(), k, on_error=on_error)
    with pytest.raises(RuntimeError, match=r"^kernel failed to launch \(7\)$"):
        t.launch(call())


def test_the_oldest_signature_goes_first_when_full(table):
    t, _ = table
    k = Kernel()
    for heads in range(10):  # capacity 8
        bind(t, call(heads=heads), k)
    assert t.size() == 8
    assert not t.launch(call(heads=0)) and not t.launch(call(heads=1))
    assert all(t.launch(call(heads=h)) for h in range(2, 10))


def test_rebinding_a_signature_replaces_its_launch(table):
    t, state = table
    old, new = Kernel(), Kernel()
    bind(t, call(), old)
    template = struct.pack(f"<{WORDS}Q", *range(100, 100 + WORDS))
    assert t.bind(call(), template, ((1, 0),), new.address, 1, lambda code: None)
    state["device"] = 1
    fresh = call()
    assert t.size() == 1 and t.launch(fresh) and old.calls == []
    (words, stream), = new.calls
    assert words[1] == fresh[0].data_ptr() and words[0] == 100 and words[3] == 103 and stream == 1001


def test_the_table_holds_one_reference_to_each_error_handler(table):
    t, _ = table
    k = Kernel()

    def on_error(code):
        pass

    base = sys.getrefcount(on_error)
    bind(t, call(), k, on_error=on_error)
    bind(t, call(heads=1), k, on_error=on_error)
    assert sys.getrefcount(on_error) == base + 2
    bind(t, call(), k)  # replaced by another handler
    assert sys.getrefcount(on_error) == base + 1
    for heads in range(10, 18):  # capacity 8: evicts call(), then call(heads=1)
        bind(t, call(heads=heads), k)
    assert sys.getrefcount(on_error) == base
    bind(t, call(), k, on_error=on_error)
    t.clear()
    assert sys.getrefcount(on_error) == base and t.size() == 0


@pytest.mark.parametrize("slots", [((WORDS, 0),), ((0, 2),), ((0, 99),)],
                         ids=["word past the template", "argument not a tensor", "argument past the end"])
def test_a_slot_that_names_no_tensor_is_refused(table, slots):
    t, _ = table
    with pytest.raises(ValueError, match="^bind: a slot outside the template, or naming an argument that is not a tensor$"):
        t.bind(call(), TEMPLATE, slots, Kernel().address, 0, lambda code: None)
    assert t.size() == 0
