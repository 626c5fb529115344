"""RowReader reads exactly the bytes asked for through short reads and EINTR, names the tensor when the file
ends early, refuses a file changed since it was opened; runs coalesce adjacent rows; tensor offsets are the file's."""

import os

import numpy as np
import pytest
import torch

from hotcold.gguf.io import GGUFError, ModelFile
from hotcold.storage.ffn import StoredMatrix
from hotcold.storage.reader import Job, RowReader, runs, tensor_offset


@pytest.fixture
def blob(tmp_path):
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, size=1 << 16, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return path, data


def flaky_pread(calls):
    """preadv that gives at most 7 bytes a call and raises EINTR on every third call."""

    def pread(fd, buffers, offset):
        calls.append(offset)
        if len(calls) % 3 == 0:
            raise InterruptedError
        (view,) = buffers
        n = min(7, len(view))
        got = os.pread(fd, n, offset)
        view[: len(got)] = got
        return len(got)

    return pread


@pytest.mark.parametrize("depth", [1, 4])
def test_short_reads_and_eintr_still_read_every_byte(blob, depth):
    path, data = blob
    calls = []
    reader = RowReader(path, depth=depth, pread=flaky_pread(calls))
    bufs = [bytearray(n) for n in (100, 1, 4096, 333)]
    offsets = [0, 999, 12345, len(data) - 333]
    jobs = [Job(o, memoryview(b), f"part {i}") for i, (o, b) in enumerate(zip(offsets, bufs))]
    assert reader.read(jobs) == sum(len(b) for b in bufs)
    for o, b in zip(offsets, bufs):
        assert bytes(b) == data[o : o + len(b)]
    assert len(calls) > sum(-(-len(b) // 7) for b in bufs)  # the interrupted calls were asked again
    reader.close()


def test_the_end_of_the_file_is_an_error_naming_the_rows(blob):
    path, data = blob
    reader = RowReader(path, depth=2)
    jobs = [Job(len(data) - 10, memoryview(bytearray(20)), "tensor blk.1.ffn_up.weight rows 7..8")]
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_up\.weight rows 7\.\.8: the file ends at byte 65536"):
        reader.read(jobs)
    reader.close()


def test_a_changed_file_is_refused(blob):
    path, data = blob
    reader = RowReader(path)
    reader.check()
    with open(path, "r+b") as f:
        f.write(b"x")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(GGUFError, match="changed on disk since it was loaded"):
        reader.check()
    reader.close()


def test_runs_coalesce_adjacent_rows():
    assert runs(np.array([3, 4, 5, 9, 11, 12])) == [(0, 3, 3), (3, 9, 1), (4, 11, 2)]
    assert runs(np.array([], dtype=np.int64)) == []


def test_jobs_are_one_read_per_run_at_the_tensor_offset(tmp_path):
    from benchmarks.synth import synthesize

    path = tmp_path / "t.powerinfer.gguf"
    synthesize(path, n_embd=64, n_ff=256, n_layer=1, n_head=4, n_head_kv=2, rank=16, n_vocab=300)
    mf = ModelFile(path)
    name = "blk.0.ffn_down_t.weight"
    where, offset = tensor_offset(mf, name)
    assert where == path
    weight = torch.from_numpy(np.asarray(mf.tensors[name].data))
    m = StoredMatrix(name, offset, weight)
    rows = np.array([0, 1, 2, 50, 255])
    block = torch.empty(len(rows), m.row_bytes, dtype=torch.uint8)
    jobs = m.jobs(rows, np.arange(len(rows)), block)
    assert len(jobs) == 3
    assert RowReader(path).read(jobs) == block.numel()
    assert torch.equal(m.weight(block), weight[torch.from_numpy(rows)])


def test_an_aligned_copy_has_page_aligned_tensors_and_the_same_logits(files, tmp_path):
    import hotcold
    from hotcold.storage.align import align_file
    from hotcold.storage.reader import misaligned

    src = files["f16"]
    dst = align_file(src, tmp_path / "aligned.powerinfer.gguf")
    before, after = ModelFile(src), ModelFile(dst)
    assert [e.name for e in after.tensors.values()] == [e.name for e in before.tensors.values()]
    assert all(tensor_offset(after, n)[1] % 4096 == 0 for n in after.tensors)
    assert misaligned([544], [4096]) and not misaligned([0, 544], [4096, 1152])
    ids = [1, 17, 40, 99]
    a = hotcold.load(src, device="cpu", ctx_size=64).logits(ids)
    b = hotcold.load(dst, device="cpu", ctx_size=64, ram_budget=1.0).logits(ids)
    assert torch.equal(a, b)
    assert (tmp_path / "activation" / "activation_0.pt").exists()
