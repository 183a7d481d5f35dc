"""Every collective hsgd uses, as thin explicit wrappers on mpi4py's buffer methods, recorded and checkable.

    comm = Comm(mpi_comm, "tp", stats)      # a communicator with a name and a shared CommStats
    comm.Allreduce(x)                       # in place: x <- sum over ranks (op=MPI.MAX for the max)
    comm.Allgather(part, out)               # out[r] <- part of rank r           out: (size, *part.shape)
    comm.Reduce_scatter_block(full, out)    # out <- (sum over ranks of full)[rank]  full: (size, *out.shape)
    comm.Alltoall(send, recv)               # block j of recv <- block rank of rank j's send (a transpose)
    comm.Alltoallv(send, send_counts, recv, recv_counts)   # the same with rows per (sender, receiver) counted
    req = comm.Iallreduce(x); req.Wait()    # non-blocking, in place
    comm.Bcast(x, root);  comm.Send(x, dest);  comm.Recv(x, source);  comm.Isend / comm.Irecv

Buffer rules, stated once here:
  * Buffers are C-contiguous arrays (preallocated by the caller where it matters); a non-contiguous view is an
    error, not a silent copy.
  * CuPy arrays: the current stream is synchronized before MPI touches the memory. With a CUDA-aware MPI the
    device pointer goes to MPI directly; otherwise the data is staged through host memory: pinned (page-locked)
    host buffers from a pool (HostStaging), taken for one call and given back when MPI is done with them, so
    that after the first step every shape has its buffer and nothing is allocated. Which of the two is used is
    decided once per process (`cuda_aware_mpi()`; HSGD_CUDA_AWARE=0|1 overrides the detection).

Accounting: every call adds, for (communicator name, operation), one call, its payload bytes and its seconds
to a CommStats. The payload is the size of the whole logical tensor of the call: Allreduce and Bcast the
buffer, Allgather the gathered result, Reduce_scatter_block the full input, Alltoall and Alltoallv the send buffer
(this rank's own block included, as Allgather's and Reduce_scatter_block's), Send/Recv the message. On a one-rank
communicator the collectives skip MPI (and any stream synchronization or staging) but are still counted, as
the formulas count them.

Collective-sequence check (HSGD_CHECK_COLLECTIVES=1, or check=True): before each collective the ranks of the
communicator exchange (operation, communicator, shapes, dtype, call number) with a small pickled allgather;
when they differ, every rank raises CollectiveMismatch naming each rank's call, instead of hanging. Alltoallv's
buffers have as many rows as its counts say, different on every rank: its check compares the shape of a row and
every rank's counts (rank i's send_counts[j] must be rank j's recv_counts[i]), in the same one allgather.
(It cannot catch a rank that never calls the check at all on this communicator.)
"""
import ctypes
import functools
import os
import threading
import time

import numpy as np
from mpi4py import MPI


class CollectiveMismatch(RuntimeError):
    """Ranks of one communicator called different collectives (or shapes, dtypes) at the same point."""


def cuda_support_query():
    """MPIX_Query_cuda_support (MPICH and Open MPI export it), or None. The process's global symbols first, then
    each libmpi it has loaded (/proc/self/maps): a wheel's MPI (PyPI's mpich) is loaded out of the global namespace."""
    try:
        with open("/proc/self/maps") as maps:
            libs = sorted({line.split()[-1] for line in maps if "/libmpi" in line})
    except OSError:
        libs = []
    for lib in [None] + [p for p in libs if os.path.basename(p).startswith("libmpi")]:
        try:
            query = ctypes.CDLL(lib).MPIX_Query_cuda_support
        except (AttributeError, OSError):
            continue
        query.restype = ctypes.c_int
        return query
    return None


@functools.lru_cache(maxsize=None)
def cuda_aware_mpi():
    """Whether device buffers may be given to MPI directly: $HSGD_CUDA_AWARE, else MPICH/Open MPI's query (an MPI
    without the query is taken as not CUDA-aware)."""
    env = os.environ.get("HSGD_CUDA_AWARE")
    if env in ("0", "1"):
        return env == "1"
    query = cuda_support_query()
    return bool(query()) if query is not None else False


def _nothing():
    """What _buf returns to call after MPI when there is nothing to copy back or give back."""


def _is_cupy(x):
    return type(x).__module__.startswith("cupy")


class HostStaging:
    """A pool of host buffers for staging device arrays through an MPI that cannot read device memory.

    take(shape, dtype) hands out a free buffer of that shape and dtype, allocating one only when none is free;
    give(buf) returns it once the MPI call that used it has completed (a blocking call: when it returns; a
    non-blocking one: at Wait). The pool keeps, for each shape, as many buffers as were ever in use at once. A
    training step stages the same shapes every step (gradient buckets, activations of a fixed size), so the pool
    holds one step's peak and allocates nothing after the first step, whatever addresses the device arrays have.
    Pinned (page-locked) memory lets the device-host copies run at full speed.
    A returned buffer may still be read by an asynchronous copy: the host-to-device copy (x.set) that ends a
    "recv" or "inout" call. Two rules make that safe: Comm._buf synchronizes the stream before it takes a buffer,
    so the copy has finished before MPI writes into the buffer again; and buffers are only dropped (when
    `max_bytes` is set: the free bytes above it, least recently returned first) in take, after that
    synchronization. `alloc(nbytes)` gives the raw memory: CuPy's pinned allocator by default; tests pass a
    plain one."""

    def __init__(self, alloc=None, max_bytes=None):
        self.alloc = alloc
        self.max_bytes = max_bytes              # None: keep every free buffer (one step's peak)
        self.free = []                          # [NumPy array over pinned memory], least recently returned first
        self.free_bytes = 0                     # bytes of the free buffers
        self.allocated = 0                      # how many buffers were ever allocated (tests read it)

    def take(self, shape, dtype):
        """A buffer of this shape and dtype that nobody else uses until it is given back. Call it only after the
        stream is synchronized (Comm._buf does)."""
        while self.max_bytes is not None and self.free_bytes > self.max_bytes and len(self.free) > 1:
            self.free_bytes -= self.free.pop(0).nbytes            # least recently returned first, keeping one
        shape, dtype = tuple(shape), np.dtype(dtype)
        for i in range(len(self.free) - 1, -1, -1):             # the most recently returned first
            buf = self.free[i]
            if buf.shape == shape and buf.dtype == dtype:
                del self.free[i]
                self.free_bytes -= buf.nbytes
                return buf
        n = int(np.prod(shape, dtype=np.int64))
        alloc = self.alloc
        if alloc is None:
            import cupy
            alloc = cupy.cuda.alloc_pinned_memory
        mem = alloc(max(1, n * dtype.itemsize))
        self.allocated += 1
        return np.frombuffer(mem, dtype=dtype, count=n).reshape(shape)

    def give(self, buf):
        """Return a buffer taken earlier: free for the next take of its shape."""
        if any(b is buf for b in self.free):
            raise ValueError("a staging buffer was given back twice (it would be handed to two calls at once)")
        self.free.append(buf)
        self.free_bytes += buf.nbytes


class CommStats:
    """(communicator name, operation) -> [calls, payload bytes, seconds], shared by all Comms of a process."""

    def __init__(self):
        self.table = {}
        self.lock = threading.Lock()            # threads of one rank may record at once (stage.ThreadedStage)

    def add(self, comm, op, nbytes, seconds):
        with self.lock:
            row = self.table.setdefault((comm, op), [0, 0, 0.0])
            row[0] += 1
            row[1] += int(nbytes)
            row[2] += seconds

    def calls(self, comm, op):
        return self.table.get((comm, op), [0, 0, 0.0])[0]

    def nbytes(self, comm, op=None):
        """Payload bytes on `comm`, of one operation or (op=None) of all."""
        return sum(r[1] for (c, o), r in self.table.items() if c == comm and (op is None or o == op))

    def seconds(self, comm):
        return sum(r[2] for (c, _), r in self.table.items() if c == comm)

    def counts(self):
        """{(comm, op): (calls, bytes)}, for comparing with a formula."""
        return {k: (v[0], v[1]) for k, v in self.table.items()}

    def since(self, before):
        """{(comm, op): (calls, bytes)} recorded since `before` (an earlier counts()): e.g. one step's traffic."""
        return {k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1])
                for k, v in self.counts().items() if v != before.get(k)}

    def reset(self):
        self.table.clear()

    def format(self):
        lines = [f"{'communicator':<13}{'operation':<22}{'calls':>7}{'bytes':>14}{'seconds':>10}"]
        for (c, o), (n, b, s) in sorted(self.table.items()):
            lines.append(f"{c:<13}{o:<22}{n:>7}{b:>14,}{s:>10.4f}")
        return "\n".join(lines)


class Request:
    """A pending non-blocking call; Wait() completes it, copies staged data back to the device and gives the host
    buffer back (staging only), and records its time."""

    def __init__(self, req, comm, op, nbytes, t0, done=_nothing):
        self.req, self.comm, self.op, self.nbytes, self.t0, self.done = req, comm, op, nbytes, t0, done
        self.waited = False

    def Wait(self):
        self.req.Wait()
        if self.waited:                                         # a second Wait: nothing more to do (the staging
            return                                              # buffer must not go back to the pool twice)
        self.waited = True
        self.done()
        self.comm._record(self.op, self.nbytes, self.t0, track="async")


class Comm:
    def __init__(self, comm, name, stats=None, check=None):
        self.comm = comm                        # the mpi4py communicator
        self.name = name                        # "world", "tp", "dp", "pp", ...: the key of the accounting
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.stats = stats if stats is not None else CommStats()
        self.check = os.environ.get("HSGD_CHECK_COLLECTIVES") == "1" if check is None else check
        self.ncalls = 0                         # collectives called so far: the sequence number of the check
        self.tracer = None                      # an hsgd.grid.trace.Tracer: every call becomes a span on the comm track
        self.payload_round = None               # bfloat16 / float16 runs: rounds partial sums before they travel
                                                # (hsgd.tp.layers.payload; hsgd.model.precision)
        self.staging = HostStaging()            # pinned host buffers, used only for CuPy arrays without CUDA-aware MPI

    # ---------------------------------------------------------------------------------------------- helpers
    def _buf(self, x, role="inout"):
        """(what to hand MPI, a function to call once MPI is done with it). role: "send" buffers are only read by
        MPI, "recv" buffers only written, "inout" both. With staging, the function copies what MPI wrote back to
        the device ("recv", "inout") and gives the host buffer back to the pool; otherwise it does nothing."""
        if not x.flags.c_contiguous:
            raise ValueError(f"{self.name}: MPI buffers must be C-contiguous (got strides {x.strides}); "
                             "pass xp.ascontiguousarray(x) or a preallocated buffer")
        if not _is_cupy(x):
            return x, _nothing
        import cupy
        cupy.cuda.get_current_stream().synchronize()            # the kernels that wrote x are done, and the
        if cuda_aware_mpi():                                    # copies out of returned host buffers too
            return x, _nothing
        host = self.staging.take(x.shape, x.dtype)              # pinned, from the pool
        if role != "recv":
            x.get(out=host)                                     # device -> host, before MPI reads it

        def done():
            if role != "send":
                x.set(host)                     # host -> device after MPI wrote it; asynchronous from pinned
            self.staging.give(host)             # memory, finished by the stream sync of the next _buf
        return host, done

    def _verify(self, op, *arrays, counts=None):
        """The collective-sequence check: all ranks must be making the same call. counts (Alltoallv): this rank's
        (send_counts, recv_counts); the arrays' rows then differ between ranks, so only a row's shape is compared
        (shown as ('*', ...)), and the counts must pair up: rank i's send_counts[j] == rank j's recv_counts[i]."""
        shapes = tuple(tuple(a.shape) if counts is None else ("*", *a.shape[1:]) for a in arrays)
        sig = (op, self.name, shapes, str(arrays[0].dtype) if arrays else "", self.ncalls)
        self.ncalls += 1
        if not self.check or self.size == 1:                    # one rank cannot disagree with itself
            return
        if counts is not None:                                  # the signature and the counts in one exchange
            gathered = self.comm.allgather((sig, counts))
            sigs = [g[0] for g in gathered]
        else:
            sigs = self.comm.allgather(sig)
        if any(s != sigs[0] for s in sigs):
            by_call = {}
            for r, s in enumerate(sigs):
                by_call.setdefault(s, []).append(r)
            calls = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {s[0]} "
                              f"shapes={list(s[2])} dtype={s[3]} call #{s[4]}" for s, rs in by_call.items())
            raise CollectiveMismatch(f"collective mismatch on communicator '{self.name}' (ranks called different "
                                     f"collectives at the same point): {calls}")
        if counts is not None:
            sends, recvs = [g[1][0] for g in gathered], [g[1][1] for g in gathered]     # [rank] -> its counts
            bad = [f"rank {i} has {len(sends[i])} send and {len(recvs[i])} recv counts, not {self.size}"
                   for i in range(self.size) if len(sends[i]) != self.size or len(recvs[i]) != self.size]
            bad = bad or [f"rank {i}'s send_counts[{j}] = {sends[i][j]} but rank {j}'s recv_counts[{i}] = {recvs[j][i]}"
                          for i in range(self.size) for j in range(self.size) if sends[i][j] != recvs[j][i]]
            if bad:
                raise CollectiveMismatch(f"{op} counts disagree on communicator '{self.name}' (call #{sig[4]}): "
                                         f"{'; '.join(bad)} (they must be equal: exchange the counts with "
                                         "Alltoall first)")

    def _record(self, op, nbytes, t0, track="comm"):
        t1 = time.perf_counter()
        self.stats.add(self.name, op, nbytes, t1 - t0)
        if self.tracer is not None:
            self.tracer.add(op, track, t0, t1, comm=self.name, bytes=int(nbytes))

    # ---------------------------------------------------------------------------------------------- collectives
    def Allreduce(self, x, op=MPI.SUM):
        """In place: x <- op over the ranks of x."""
        self._verify("Allreduce", x)
        t0 = time.perf_counter()
        if self.size == 1:                                      # one rank: the result is x (no stream sync,
            self._record("Allreduce", x.nbytes, t0)             # no staging); still counted, as the formulas do
            return x
        b, done = self._buf(x)
        self.comm.Allreduce(MPI.IN_PLACE, b, op=op)
        done()
        self._record("Allreduce", x.nbytes, t0)
        return x

    def Iallreduce(self, x, op=MPI.SUM):
        """Start an in-place Allreduce of x; returns a Request whose Wait() completes it."""
        self._verify("Iallreduce", x)
        t0 = time.perf_counter()
        b, done = self._buf(x)
        return Request(self.comm.Iallreduce(MPI.IN_PLACE, b, op=op), self, "Iallreduce", x.nbytes, t0, done)

    def _exchange(self, op, send, recv, nbytes, call, alone):
        """A blocking collective from a send buffer into a receive buffer: call(s, r) on the buffers MPI gets
        (_buf: staged through the host where needed), or alone() on a one-rank communicator (a copy, no MPI);
        either way recorded as op with payload nbytes. Returns recv."""
        t0 = time.perf_counter()
        if self.size == 1:
            alone()
        else:
            s, sent = self._buf(send, "send")
            r, received = self._buf(recv, "recv")
            call(s, r)
            sent()
            received()
        self._record(op, nbytes, t0)
        return recv

    def Allgather(self, part, out):
        """out[r] <- `part` of rank r. out has shape (size, *part.shape)."""
        self._verify("Allgather", part, out)
        assert out.shape == (self.size, *part.shape), (out.shape, part.shape)
        return self._exchange("Allgather", part, out, out.nbytes, self.comm.Allgather,
                              lambda: out.__setitem__(0, part))

    def Reduce_scatter_block(self, full, out, op=MPI.SUM):
        """out <- (op over ranks of full)[rank]. full has shape (size, *out.shape)."""
        self._verify("Reduce_scatter_block", full, out)
        assert full.shape == (self.size, *out.shape), (full.shape, out.shape)
        return self._exchange("Reduce_scatter_block", full, out, full.nbytes,
                              lambda s, r: self.comm.Reduce_scatter_block(s, r, op=op),
                              lambda: out.__setitem__(Ellipsis, full[0]))

    def Ireduce_scatter_block(self, full, out, op=MPI.SUM):
        """Start out <- (op over ranks of full)[rank]; returns a Request whose Wait() completes it (neither
        buffer may be touched before)."""
        self._verify("Ireduce_scatter_block", full, out)
        assert full.shape == (self.size, *out.shape), (full.shape, out.shape)
        t0 = time.perf_counter()
        s, sent = self._buf(full, "send")
        r, received = self._buf(out, "recv")
        req = Request(self.comm.Ireduce_scatter_block(s, r, op=op), self, "Ireduce_scatter_block", full.nbytes, t0,
                      lambda: (sent(), received()))
        req.keepalive = (full, out)                             # MPI may use both until Wait
        return req

    def Alltoall(self, send, recv):
        """Block j of recv <- block `rank` of rank j's send: send and recv have the same shape (n, ...), n a
        multiple of size, and block j is rows j*n/size .. (j+1)*n/size - 1.

        Stack the ranks' send buffers as a (size x size) matrix of blocks, S[i, j] = block j of rank i's send
        (what i has for j); then R[j, i] = S[i, j]: the all-to-all is the transpose of that block matrix. A
        transpose is its own inverse, and as a linear map of all ranks' data it is a permutation, so its adjoint is
        its inverse: Alltoall again (<Alltoall x, y> = <x, Alltoall y>). Each rank keeps one block and sends the
        other size-1: (size-1)/size of the payload leaves it, the payload being send.nbytes."""
        self._verify("Alltoall", send, recv)
        if send.shape != recv.shape or send.shape[0] % self.size:
            raise ValueError(f"{self.name}: Alltoall needs send and recv of one shape (n, ...) with n a multiple of "
                             f"{self.size} (got {send.shape} and {recv.shape}); use Alltoallv for uneven blocks")
        return self._exchange("Alltoall", send, recv, send.nbytes, self.comm.Alltoall,
                              lambda: recv.__setitem__(Ellipsis, send))

    def Alltoallv(self, send, send_counts, recv, recv_counts):
        """The all-to-all with rows counted: send_counts[j] rows of send go to rank j (send's rows in rank order:
        those for rank 0, then those for rank 1, ...: the displacements are the running sums of the counts), and
        recv receives recv_counts[i] rows from rank i, in rank order. send: (sum(send_counts), ...), recv:
        (sum(recv_counts), ...), the same row shape and dtype on every rank. The counts must pair up, rank i's
        send_counts[j] == rank j's recv_counts[i]: exchange them first with an Alltoall of the (size,) counts.

        As a matrix, A moves row k of block (i -> j) of rank i's send to the same place of block (from i) of rank
        j's recv: a 0/1 matrix with one 1 per row and column, so A^T = A^-1, which is the Alltoallv with the
        counts swapped (send_counts <-> recv_counts): <A x, y> = <x, A^T y>. A dispatch (tokens to the ranks
        of their experts) and the combine (results back) are each other's adjoint, so the backward of the
        dispatch makes the combine's communication, and the backward of the combine the dispatch's. Payload: the
        rows sent, send.nbytes, this rank's own send_counts[rank] rows included (they are copied, not sent)."""
        send_counts = [int(c) for c in send_counts]
        recv_counts = [int(c) for c in recv_counts]
        self._verify("Alltoallv", send, recv, counts=(send_counts, recv_counts))
        if (len(send_counts) != self.size or len(recv_counts) != self.size or min(send_counts + recv_counts) < 0
                or send.shape[0] != sum(send_counts) or recv.shape[0] != sum(recv_counts)
                or send.shape[1:] != recv.shape[1:]):
            raise ValueError(f"{self.name}: Alltoallv needs {self.size} counts >= 0 each, send of sum(send_counts) "
                             f"rows and recv of sum(recv_counts) rows of one shape (got send {send.shape}, counts "
                             f"{send_counts}; recv {recv.shape}, counts {recv_counts})")
        row = int(np.prod(send.shape[1:], dtype=np.int64))     # elements per row: MPI counts elements
        s_counts, r_counts = [c * row for c in send_counts], [c * row for c in recv_counts]
        s_displs = [0, *np.cumsum(s_counts[:-1]).tolist()]     # where the rows for rank j start
        r_displs = [0, *np.cumsum(r_counts[:-1]).tolist()]
        return self._exchange("Alltoallv", send, recv, send.nbytes,
                              lambda s, r: self.comm.Alltoallv([s, (s_counts, s_displs)], [r, (r_counts, r_displs)]),
                              lambda: recv.__setitem__(Ellipsis, send))

    def Bcast(self, x, root=0):
        self._verify("Bcast", x)
        t0 = time.perf_counter()
        b, done = self._buf(x, "send" if self.rank == root else "recv")     # the root reads, the others write
        self.comm.Bcast(b, root=root)
        done()
        self._record("Bcast", x.nbytes, t0)
        return x

    def Barrier(self):
        self._verify("Barrier")
        self.comm.Barrier()

    # ---------------------------------------------------------------------------------------------- point to point
    def Send(self, x, dest, tag=0):
        t0 = time.perf_counter()
        b, sent = self._buf(x, "send")
        self.comm.Send(b, dest=dest, tag=tag)
        sent()
        self._record("Send", x.nbytes, t0)

    def Recv(self, x, source, tag=0):
        t0 = time.perf_counter()
        b, done = self._buf(x, "recv")
        self.comm.Recv(b, source=source, tag=tag)
        done()
        self._record("Recv", x.nbytes, t0)
        return x

    def Isend(self, x, dest, tag=0):
        t0 = time.perf_counter()
        b, sent = self._buf(x, "send")
        req = Request(self.comm.Isend(b, dest=dest, tag=tag), self, "Isend", x.nbytes, t0, sent)
        req.keepalive = x                                       # MPI may read x's memory until Wait
        return req

    def Irecv(self, x, source, tag=0):
        t0 = time.perf_counter()
        b, done = self._buf(x, "recv")
        return Request(self.comm.Irecv(b, source=source, tag=tag), self, "Irecv", x.nbytes, t0, done)

    # ---------------------------------------------------------------------------------------------- small metadata
    def allgather_obj(self, obj):
        """Lowercase (pickled) allgather: for small metadata only, never for arrays in the hot path."""
        return self.comm.allgather(obj)

    def free(self):
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.comm.Free()
