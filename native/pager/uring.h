// uring: one io_uring instance that reads into registered (pinned once) buffers, one request at a
// time, for io_pool's reading threads (docs/DESIGN.md §3e: a pread pins its destination pages on
// every call, and on two cores that CPU is taken from the compute threads).
//
// Invariant: a read through the ring touches only the bytes [dst, dst + len) of the registered
// buffer it names, and returns only after the kernel completed it; a buffer is (re)registered or
// dropped only while no read of this ring uses it, so a dropped buffer's pages are never written
// again and punching them out of the arena memfd cannot leave a stale pinned copy behind. Raw
// system calls (<linux/io_uring.h>); no liburing, so building needs nothing beyond the kernel headers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct io_uring_sqe;
struct io_uring_cqe;

class uring {
public:
    uring() = default;
    ~uring();
    uring(const uring &) = delete;
    uring & operator=(const uring &) = delete;

    // Creates the ring; "" on success, else why not (the kernel refused: too old, io_uring
    // disabled by sysctl or seccomp).
    std::string init();
    bool ok() const { return fd_ >= 0 && !broken_; }

    // Registers bufs (address, bytes) as fixed buffers 0..n-1 (a null address: an empty entry);
    // "" or why not (RLIMIT_MEMLOCK without CAP_IPC_LOCK, a kernel before 5.19).
    std::string register_buffers(const std::vector<std::pair<char *, int64_t>> & bufs);
    // Shares src's registered buffers (IORING_REGISTER_CLONE_BUFFERS, Linux 6.12+: one pinned copy and
    // one page table of them for every ring); "" or why not (the caller registers its own instead).
    std::string clone_buffers(const uring & src);
    // Replaces buffer i by (addr, bytes), or drops it (addr null); 0 or -errno.
    int update_buffer(int i, char * addr, int64_t bytes);

    // One READ_FIXED of len bytes at file offset off into dst (inside buffer buf_index); the
    // bytes read (>= 0) or the read's -errno. INT64_MIN when the ring itself failed (ok() is then
    // false: the caller reads another way).
    int64_t read_fixed(int fd, char * dst, int64_t len, int64_t off, int buf_index);

private:
    int            fd_ = -1;
    bool           broken_ = false;  // io_uring_enter failed: never used again (a pending entry is never submitted)
    void *         sq_ptr_ = nullptr;  // the submission and completion rings, one mapping
    size_t         sq_bytes_ = 0, sqes_bytes_ = 0;
    unsigned *     sq_head_ = nullptr, * sq_tail_ = nullptr, * sq_mask_ = nullptr, * sq_array_ = nullptr;
    unsigned *     cq_head_ = nullptr, * cq_tail_ = nullptr, * cq_mask_ = nullptr;
    io_uring_sqe * sqes_ = nullptr;
    io_uring_cqe * cqes_ = nullptr;
};
