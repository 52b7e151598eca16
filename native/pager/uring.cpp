// uring: see uring.h for the invariant. The submission and completion rings are shared with the
// kernel: the tail we write is published with a release store, the tail the kernel writes is read
// with an acquire load (the io_uring memory-ordering contract, io_uring_setup(2)).
#include "uring.h"

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

static int sys_setup(unsigned entries, io_uring_params * p) { return (int) syscall(__NR_io_uring_setup, entries, p); }
static int sys_enter(int fd, unsigned submit, unsigned complete, unsigned flags) {
    return (int) syscall(__NR_io_uring_enter, fd, submit, complete, flags, nullptr, 0);
}
static int sys_register(int fd, unsigned op, const void * arg, unsigned n) {
    return (int) syscall(__NR_io_uring_register, fd, op, arg, n);
}

uring::~uring() {
    if (sqes_) munmap(sqes_, sqes_bytes_);
    if (sq_ptr_) munmap(sq_ptr_, sq_bytes_);  // both rings (IORING_FEAT_SINGLE_MMAP)
    if (fd_ >= 0) close(fd_);  // drops the registered buffers (unpins their pages)
}

std::string uring::init() {
    io_uring_params p;
    std::memset(&p, 0, sizeof p);
    const int fd = sys_setup(2, &p);
    if (fd < 0) return std::string("io_uring_setup: ") + std::strerror(errno);
    fd_ = fd;
    if (!(p.features & IORING_FEAT_SINGLE_MMAP)) {
        close(fd_);
        fd_ = -1;
        return "io_uring without IORING_FEAT_SINGLE_MMAP (a kernel before 5.4)";
    }
    // one mapping holds both rings: the larger of the two ring sizes
    const size_t sq = p.sq_off.array + p.sq_entries * sizeof(unsigned), cq = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    sq_bytes_ = sq > cq ? sq : cq;
    sq_ptr_ = mmap(nullptr, sq_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQ_RING);
    if (sq_ptr_ == MAP_FAILED) {
        sq_ptr_ = nullptr;
        return std::string("mmap of the io_uring rings: ") + std::strerror(errno);
    }
    sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    void * s = mmap(nullptr, sqes_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, IORING_OFF_SQES);
    if (s == MAP_FAILED) return std::string("mmap of the io_uring entries: ") + std::strerror(errno);
    sqes_ = (io_uring_sqe *) s;
    char * r = (char *) sq_ptr_;
    sq_head_ = (unsigned *) (r + p.sq_off.head);
    sq_tail_ = (unsigned *) (r + p.sq_off.tail);
    sq_mask_ = (unsigned *) (r + p.sq_off.ring_mask);
    sq_array_ = (unsigned *) (r + p.sq_off.array);
    cq_head_ = (unsigned *) (r + p.cq_off.head);
    cq_tail_ = (unsigned *) (r + p.cq_off.tail);
    cq_mask_ = (unsigned *) (r + p.cq_off.ring_mask);
    cqes_ = (io_uring_cqe *) (r + p.cq_off.cqes);
    return "";
}

std::string uring::register_buffers(const std::vector<std::pair<char *, int64_t>> & bufs) {
    std::vector<iovec> iov(bufs.size());
    std::vector<uint64_t> tags(bufs.size(), 0);
    for (size_t i = 0; i < bufs.size(); i++) iov[i] = {bufs[i].first, bufs[i].first ? (size_t) bufs[i].second : 0};
    io_uring_rsrc_register r;
    std::memset(&r, 0, sizeof r);
    r.nr = (unsigned) iov.size();
    r.data = (uint64_t) (uintptr_t) iov.data();
    r.tags = (uint64_t) (uintptr_t) tags.data();
    if (sys_register(fd_, IORING_REGISTER_BUFFERS2, &r, sizeof r) < 0)
        return std::string("registering ") + std::to_string(bufs.size()) + " io_uring buffers: " + std::strerror(errno) +
               (errno == ENOMEM ? " (RLIMIT_MEMLOCK: the arena's pages are pinned; raise `ulimit -l`)" : "");
    return "";
}

// IORING_REGISTER_CLONE_BUFFERS and its argument (include/uapi/linux/io_uring.h of Linux 6.13; older
// kernel headers lack them, and a kernel before 6.12 answers EINVAL). All zero but src_fd: clone every buffer.
static constexpr unsigned kRegisterCloneBuffers = 30;
struct clone_buffers_arg {
    uint32_t src_fd, flags, src_off, dst_off, nr, pad[3];
};

std::string uring::clone_buffers(const uring & src) {
    clone_buffers_arg a;
    std::memset(&a, 0, sizeof a);
    a.src_fd = (uint32_t) src.fd_;
    if (sys_register(fd_, kRegisterCloneBuffers, &a, 1) < 0) return std::string("cloning io_uring buffers: ") + std::strerror(errno);
    return "";
}

int uring::update_buffer(int i, char * addr, int64_t bytes) {
    iovec iov{addr, addr ? (size_t) bytes : 0};
    uint64_t tag = 0;
    io_uring_rsrc_update2 u;
    std::memset(&u, 0, sizeof u);
    u.offset = (unsigned) i;
    u.data = (uint64_t) (uintptr_t) &iov;
    u.tags = (uint64_t) (uintptr_t) &tag;
    u.nr = 1;
    return sys_register(fd_, IORING_REGISTER_BUFFERS_UPDATE, &u, sizeof u) < 0 ? -errno : 0;
}

int64_t uring::read_fixed(int fd, char * dst, int64_t len, int64_t off, int buf_index) {
    const unsigned tail = *sq_tail_;  // only this thread writes the tail
    const unsigned idx = tail & *sq_mask_;
    io_uring_sqe * e = &sqes_[idx];
    std::memset(e, 0, sizeof *e);
    e->opcode = IORING_OP_READ_FIXED;
    e->fd = fd;
    e->off = (uint64_t) off;
    e->addr = (uint64_t) (uintptr_t) dst;
    e->len = (unsigned) len;
    e->buf_index = (uint16_t) buf_index;
    sq_array_[idx] = idx;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
    for (;;) {
        const unsigned head = *cq_head_;
        if (head != __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE)) {
            const int res = cqes_[head & *cq_mask_].res;
            __atomic_store_n(cq_head_, head + 1, __ATOMIC_RELEASE);
            return res;
        }
        // submit the entry unless the kernel took it already (an earlier call interrupted), and wait
        const unsigned submit = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE) != tail + 1 ? 1 : 0;
        if (sys_enter(fd_, submit, 1, IORING_ENTER_GETEVENTS) < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) {
            broken_ = true;
            return INT64_MIN;
        }
    }
}
