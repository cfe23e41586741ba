"""DualKVLayout (kvtransform/layout.py): construction, derived index tensors, validation errors."""
import pytest
import torch

from kvtransform.layout import DualKVLayout


def test_from_lengths_tensors_and_properties():
    lay = DualKVLayout.from_lengths([(3, [2, 1]), (4, [5])])
    assert lay.cu_seqlens.dtype == torch.int32 and lay.segment_prefix.dtype == torch.int32
    assert lay.cu_seqlens.tolist() == [0, 3, 5, 6, 10, 15]
    assert lay.segment_prefix.tolist() == [-1, 0, 0, -1, 3]
    assert lay.prefix_lens == [3, 4] and lay.response_lens == [[2, 1], [5]]
    assert lay.num_groups == 2 and lay.num_segments == 5
    assert lay.total_tokens == 15 and lay.max_seqlen == 5
    lay.validate(15)
    # pairs: group 0: 3*4/2 + (2*3 + 3) + (1*3 + 1) = 6 + 9 + 4; group 1: 10 + (5*4 + 15)
    assert lay.visible_pairs() == 19 + 45


def test_position_ids():
    lay = DualKVLayout.from_lengths([(3, [2, 1]), (2, [3])])
    assert lay.position_ids().dtype == torch.int64
    assert lay.position_ids().tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 4]


def test_replicated_index_and_cu():
    lay = DualKVLayout.from_lengths([(3, [2, 1]), (2, [3]), (4, [])])
    idx = lay.replicated_index()
    assert idx.dtype == torch.int64
    assert idx.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10]
    assert lay.replicated_cu_seqlens().tolist() == [0, 5, 9, 14]
    assert lay.replicated_cu_seqlens().dtype == torch.int32
    # replicated positions are 0..P+R-1 per sequence
    pos = lay.position_ids()[idx]
    cu = lay.replicated_cu_seqlens().tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        assert pos[a:b].tolist() == list(range(b - a))


def test_from_tensors_roundtrip_and_to():
    lay = DualKVLayout.from_lengths([(7, [1, 2, 3]), (1, [1])])
    lay2 = DualKVLayout(lay.cu_seqlens.clone(), lay.segment_prefix.clone())
    assert lay2.prefix_lens == [7, 1] and lay2.response_lens == [[1, 2, 3], [1]]
    lay3 = lay.to("cpu")
    assert torch.equal(lay3.cu_seqlens, lay.cu_seqlens) and lay3.prefix_lens == lay.prefix_lens


@pytest.mark.parametrize("groups, msg", [
    ([(0, [1])], "prompt"),
    ([(3, [2, 0])], "response 1 has length 0"),
    ([(3, [-1])], "length"),
    ([], "at least one group"),
])
def test_from_lengths_errors(groups, msg):
    with pytest.raises(ValueError, match=msg):
        DualKVLayout.from_lengths(groups)


def test_validate_errors():
    lay = DualKVLayout.from_lengths([(3, [2, 1])])
    with pytest.raises(ValueError, match="sum to T"):
        lay.validate(7)
    # malformed tensors given with python lengths: rejected on construction (the lengths must agree with them)
    with pytest.raises(ValueError, match="not monotone"):
        DualKVLayout(torch.tensor([0, 3, 2, 6], dtype=torch.int32), torch.tensor([-1, 0, 0], dtype=torch.int32),
                     [3], [[2, 1]])
    with pytest.raises(ValueError, match="length 0"):
        DualKVLayout(torch.tensor([0, 3, 3, 6], dtype=torch.int32), torch.tensor([-1, 0, 0], dtype=torch.int32),
                     [3], [[2, 1]])
    with pytest.raises(ValueError, match="directly follow"):
        DualKVLayout(torch.tensor([0, 3, 5, 6], dtype=torch.int32), torch.tensor([-1, 0, 1], dtype=torch.int32),
                     [3], [[2, 1]])
    int64 = DualKVLayout(torch.tensor([0, 3, 5, 6], dtype=torch.int64), torch.tensor([-1, 0, 0], dtype=torch.int32),
                         [3], [[2, 1]])  # stored as int32, as from_tensors does (it failed later, in validate or the op)
    assert int64.cu_seqlens.dtype == torch.int32
    int64.validate(6)
    int64.cu_seqlens = int64.cu_seqlens.long()  # (a field set afterwards is not converted)
    with pytest.raises(ValueError, match="int32"):
        int64.validate(6)
    with pytest.raises(ValueError, match="disagree"):
        DualKVLayout(lay.cu_seqlens, lay.segment_prefix, [3], [[1, 2]])
    with pytest.raises(ValueError, match="not monotone"):
        DualKVLayout(torch.tensor([0, 3, 2, 6], dtype=torch.int32), torch.tensor([-1, 0, 0], dtype=torch.int32))


@pytest.mark.parametrize("groups, msg", [
    ([(3.7, [2.2])], r"prompt \(prefix\) length must be an integer; got 3.7"),
    ([(3, [2.0])], "response 0 length must be an integer; got 2.0"),
    ([(True, [1])], "bool"),
    ([(3, [False])], "bool"),
    ([("3", [1])], "must be an integer"),
    ([(3, 2)], "response lengths must be a list"),
])
def test_from_lengths_rejects_non_integers(groups, msg):
    with pytest.raises(ValueError, match=msg):
        DualKVLayout.from_lengths(groups)


def test_from_lengths_accepts_numpy_and_torch_integers():
    np = pytest.importorskip("numpy")
    lay = DualKVLayout.from_lengths([(np.int64(3), [np.int32(2), torch.tensor(1)]), (torch.tensor(2), np.array([4]))])
    assert lay.prefix_lens == [3, 2] and lay.response_lens == [[2, 1], [4]]
    assert all(type(x) is int for x in lay.prefix_lens + [r for rs in lay.response_lens for r in rs])
    assert lay.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12]


def test_direct_construction_must_agree():
    """Tensors and python lengths that describe different layouts are rejected on construction (the kernels read
    the tensors, position_ids()/replicated_index() the lists)."""
    i32 = dict(dtype=torch.int32)
    with pytest.raises(ValueError, match=r"disagree.*from_lengths"):
        DualKVLayout(cu_seqlens=torch.tensor([0, 3, 5, 8], **i32), segment_prefix=torch.tensor([-1, 0, 0], **i32),
                     prefix_lens=[3], response_lens=[[2, 4]])
    with pytest.raises(ValueError, match="disagree"):  # same token count, different grouping
        DualKVLayout(torch.tensor([0, 3, 5, 8], **i32), torch.tensor([-1, 0, 0], **i32), [5], [[3]])
    with pytest.raises(ValueError, match="1 groups but response_lens 2"):
        DualKVLayout(torch.tensor([0, 3, 5, 8], **i32), torch.tensor([-1, 0, 0], **i32), [3], [[2], [3]])
    with pytest.raises(ValueError, match="must be an integer"):
        DualKVLayout(torch.tensor([0, 3, 5, 8], **i32), torch.tensor([-1, 0, 0], **i32), [3.0], [[2, 3]])
    with pytest.raises(ValueError, match="must be an int32 tensor.*from_lengths"):
        DualKVLayout([0, 3, 5, 8], [-1, 0, 0], [3], [[2, 3]])
    ok = DualKVLayout(torch.tensor([0, 3, 5, 8], **i32), torch.tensor([-1, 0, 0], **i32), [3], [[2, 3]])
    assert ok.position_ids().tolist() == [0, 1, 2, 3, 4, 3, 4, 5]
    # meta tensors carry no data: nothing to compare, accepted as before
    DualKVLayout(ok.cu_seqlens.to("meta"), ok.segment_prefix.to("meta"), [3], [[2, 3]])
    assert ok.to("meta").prefix_lens == [3]


@pytest.mark.parametrize("cu,sp,match", [
    (torch.tensor([0., 3., 5.]), torch.tensor([-1, 0], dtype=torch.int32), "integer offsets"),
    (torch.tensor([0, 3, 2 ** 31 + 5]), torch.tensor([-1, 0]), "outside int32"),
    (torch.tensor([0, 3, 5], device="meta"), torch.tensor([-1, 0], device="meta"), "no data to read"),
    (torch.tensor([[0, 3, 5]]), torch.tensor([-1, 0]), "1-D"),
])
def test_from_tensors_refuses_offsets_it_would_misread(cu, sp, match):
    """A float offset would be truncated, an int64 above int32 would wrap in the kernels' int32 copy, a meta tensor
    cannot be read: each is a ValueError naming the fix."""
    with pytest.raises(ValueError, match=match):
        DualKVLayout.from_tensors(cu, sp)


@pytest.mark.parametrize("make", [
    lambda cu, sp: DualKVLayout.from_tensors(cu, sp),
    lambda cu, sp: DualKVLayout(cu, sp),
    lambda cu, sp: DualKVLayout(cu, sp, [], []),
])
@pytest.mark.parametrize("cu", [torch.tensor([0], dtype=torch.int32), torch.tensor([], dtype=torch.int32)])
def test_empty_layout_is_refused_by_every_constructor(make, cu):
    """A layout with no segment is an error naming the fix, from from_tensors and from direct construction alike
    (direct construction used to accept it silently and give a layout of 0 groups)."""
    with pytest.raises(ValueError, match=r"layout is empty.*from_lengths"):
        make(cu, torch.tensor([], dtype=torch.int32))


def test_from_tensors_offsets_errors_name_the_fix():
    i32 = dict(dtype=torch.int32)
    with pytest.raises(ValueError, match=r"layout is empty.*from_lengths"):
        DualKVLayout.from_tensors(torch.tensor([0], **i32), torch.tensor([], **i32))
    with pytest.raises(ValueError, match=r"segment_prefix holds 2147483648, outside int32: entries are -1 or a "
                                         r"segment index"):
        DualKVLayout.from_tensors(torch.tensor([0, 3, 5]), torch.tensor([-1, 2 ** 31]))
    with pytest.raises(ValueError, match=r"cu_seqlens holds -2147483649, outside int32"):
        DualKVLayout.from_tensors(torch.tensor([-2 ** 31 - 1, 3, 5]), torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=r"cu_seqlens holds 2147483653, outside int32: .*at most 2\*\*31 - 1 packed"):
        DualKVLayout.from_tensors(torch.tensor([0, 3, 2 ** 31 + 5]), torch.tensor([-1, 0]))
    # integer tensors of other widths are read exactly and stored as int32
    lay = DualKVLayout.from_tensors(torch.tensor([0, 3, 5], dtype=torch.int16),
        torch.tensor([-1, 0], dtype=torch.int8))
    assert lay.cu_seqlens.dtype == torch.int32 and lay.prefix_lens == [3] and lay.response_lens == [[2]]
