// Device I/O probe (see io_probe.h).
//
// Invariant: each timed interval covers exactly one request's pread calls and nothing else — the
// offset is drawn and the buffer allocated before the clock starts — and all workers start together
// from one barrier, so `wall_s` spans only the cell's I/O and aggregate MB/s = total_bytes / wall_s.
// Offsets are multiples of 4096 and never let a request start past file_size - request_bytes, so
// every request reads request_bytes of real file data (O_DIRECT may round the length up to 4096 and
// then stop at EOF). A worker that fails records its exception and raises the shared stop flag; the
// others finish their current request and exit; run() rethrows the first error after joining, so no
// thread outlives the call and no exception escapes a thread.
#include "io_probe.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <random>
#include <thread>

namespace {

using clock_type = std::chrono::steady_clock;

std::string errno_text(int e) {
    return std::string(std::strerror(e));
}

// SplitMix64: turns (seed, cell, thread) into independent generator seeds.
uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

// A 4096-aligned heap buffer (posix_memalign), freed on scope exit.
struct AlignedBuffer {
    explicit AlignedBuffer(size_t n) {
        void * p = nullptr;
        int rc = posix_memalign(&p, (size_t) IO_PROBE_ALIGN, n == 0 ? (size_t) IO_PROBE_ALIGN : n);
        if (rc != 0) {
            throw std::bad_alloc();
        }
        data = static_cast<char *>(p);
        std::memset(data, 0, n);  // touch the pages now so first-use faults are not timed
    }
    ~AlignedBuffer() { std::free(data); }
    AlignedBuffer(const AlignedBuffer &) = delete;
    AlignedBuffer & operator=(const AlignedBuffer &) = delete;
    char * data = nullptr;
};

// Reads up to `len` bytes at `off`, retrying on EINTR and partial reads. Returns bytes read
// (less than len only at end of file). Throws IoProbeError on failure.
int64_t pread_full(int fd, const std::string & path, char * buf, int64_t len, int64_t off, bool direct) {
    int64_t got = 0;
    while (got < len) {
        ssize_t n = ::pread(fd, buf + got, (size_t) (len - got), (off_t) (off + got));
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            int e = errno;
            throw IoProbeError(path, off, e,
                               "pread of " + std::to_string(len) + " bytes at offset " + std::to_string(off) +
                               " failed: " + errno_text(e));
        }
        if (n == 0) {
            break;  // end of file
        }
        got += n;
        if (direct && got % IO_PROBE_ALIGN != 0) {
            break;  // an O_DIRECT read shorter than a block has reached end of file
        }
    }
    return got;
}

}  // namespace

IoProbeError::IoProbeError(const std::string & path_, int64_t offset_, int errno_value_, const std::string & what)
    : std::runtime_error(path_ + ": " + what), path(path_), detail(what), offset(offset_), errno_value(errno_value_) {}

IoProbe::IoProbe(const std::string & path, bool want_direct) : path_(path) {
    int fd = -1;
    bool direct = false;
    if (want_direct) {
        fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (fd >= 0) {
            direct = true;
        } else if (errno != EINVAL) {
            int e = errno;
            throw IoProbeError(path, -1, e, "cannot open: " + errno_text(e));
        }
    }
    if (fd < 0) {
        fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            int e = errno;
            throw IoProbeError(path, -1, e, "cannot open: " + errno_text(e));
        }
    }
    struct stat st;
    if (::fstat(fd, &st) != 0) {
        int e = errno;
        ::close(fd);
        throw IoProbeError(path, -1, e, "cannot stat: " + errno_text(e));
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        throw std::invalid_argument(path + ": not a regular file");
    }
    if (direct) {
        // Some filesystems accept O_DIRECT at open and refuse it at the first read.
        AlignedBuffer buf((size_t) IO_PROBE_ALIGN);
        ssize_t n;
        do {
            n = ::pread(fd, buf.data, (size_t) IO_PROBE_ALIGN, 0);
        } while (n < 0 && errno == EINTR);
        if (n < 0) {
            int e = errno;
            ::close(fd);
            if (e != EINVAL) {
                throw IoProbeError(path, 0, e, "first O_DIRECT read at offset 0 failed: " + errno_text(e));
            }
            direct = false;
            fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
            if (fd < 0) {
                int e2 = errno;
                throw IoProbeError(path, -1, e2, "cannot open: " + errno_text(e2));
            }
        }
    }
    fd_        = fd;
    file_size_ = (int64_t) st.st_size;
    direct_    = direct;
}

IoProbe::~IoProbe() {
    if (fd_ >= 0) {
        ::close(fd_);
    }
}

void IoProbe::drop_cache() {
    int rc = ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);  // returns the error number, not -1
    if (rc != 0) {
        throw IoProbeError(path_, -1, rc, "posix_fadvise(DONTNEED) failed: " + errno_text(rc));
    }
}

IoProbeCell IoProbe::run(int64_t request_bytes, int32_t concurrency, int64_t requests_per_thread,
                         uint64_t seed, bool drop) {
    if (request_bytes <= 0) {
        throw std::invalid_argument("request_bytes must be > 0, got " + std::to_string(request_bytes));
    }
    if (concurrency <= 0) {
        throw std::invalid_argument("concurrency must be > 0, got " + std::to_string(concurrency));
    }
    if (requests_per_thread <= 0) {
        throw std::invalid_argument("requests per thread must be > 0, got " + std::to_string(requests_per_thread));
    }
    if (file_size_ < request_bytes) {
        throw std::invalid_argument(path_ + ": file is " + std::to_string(file_size_) + " bytes, smaller than the " +
                                    std::to_string(request_bytes) + "-byte request");
    }

    IoProbeCell cell;
    cell.request_bytes = request_bytes;
    cell.read_bytes    = direct_ ? (request_bytes + IO_PROBE_ALIGN - 1) / IO_PROBE_ALIGN * IO_PROBE_ALIGN
                                 : request_bytes;
    cell.concurrency   = concurrency;
    cell.n_requests    = (int64_t) concurrency * requests_per_thread;
    cell.total_bytes   = 0;
    cell.wall_s        = 0.0;

    if (drop) {
        drop_cache();
    }

    // Valid start blocks: offsets 0, 4096, ..., up to file_size - request_bytes.
    const int64_t n_blocks = (file_size_ - request_bytes) / IO_PROBE_ALIGN + 1;
    const uint64_t cell_key = splitmix64(seed ^ splitmix64((uint64_t) request_bytes) ^
                                         splitmix64((uint64_t) concurrency << 40));

    std::vector<std::vector<double>> lat((size_t) concurrency);
    std::vector<int64_t>             bytes((size_t) concurrency, 0);
    std::vector<std::exception_ptr>  errors((size_t) concurrency);
    std::atomic<bool>                stop{false};

    std::mutex              mu;
    std::condition_variable cv;
    int                     ready = 0;
    bool                    go    = false;

    auto worker = [&](int t) {
        try {
            std::mt19937_64 rng(splitmix64(cell_key + (uint64_t) t));
            std::uniform_int_distribution<int64_t> pick(0, n_blocks - 1);
            std::vector<int64_t> offsets((size_t) requests_per_thread);
            for (auto & o : offsets) {
                o = pick(rng) * IO_PROBE_ALIGN;
            }
            AlignedBuffer buf((size_t) cell.read_bytes);
            std::vector<double> & my_lat = lat[(size_t) t];
            my_lat.reserve((size_t) requests_per_thread);
            {
                std::unique_lock<std::mutex> lk(mu);
                ++ready;
                cv.notify_all();
                cv.wait(lk, [&] { return go; });
            }
            for (int64_t i = 0; i < requests_per_thread && !stop.load(std::memory_order_relaxed); ++i) {
                const int64_t off = offsets[(size_t) i];
                auto t0 = clock_type::now();
                int64_t got = pread_full(fd_, path_, buf.data, cell.read_bytes, off, direct_);
                auto t1 = clock_type::now();
                if (got < request_bytes) {
                    throw IoProbeError(path_, off, EIO,
                                       "short read: " + std::to_string(got) + " of " + std::to_string(request_bytes) +
                                       " bytes at offset " + std::to_string(off) + " (file shrank?)");
                }
                my_lat.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
                bytes[(size_t) t] += got;
            }
        } catch (...) {
            errors[(size_t) t] = std::current_exception();
            stop.store(true);
            std::lock_guard<std::mutex> lk(mu);
            ++ready;  // a worker that failed before the barrier must not block the start
            cv.notify_all();
        }
    };

    std::vector<std::thread> threads;
    threads.reserve((size_t) concurrency);
    clock_type::time_point start;
    try {
        for (int t = 0; t < concurrency; ++t) {
            threads.emplace_back(worker, t);
        }
    } catch (...) {
        // Thread creation failed: release the ones already waiting, then report.
        stop.store(true);
        {
            std::lock_guard<std::mutex> lk(mu);
            go = true;
        }
        cv.notify_all();
        for (auto & th : threads) {
            th.join();
        }
        throw;
    }
    {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return ready >= concurrency; });
        start = clock_type::now();
        go    = true;
    }
    cv.notify_all();
    for (auto & th : threads) {
        th.join();
    }
    auto end = clock_type::now();

    for (auto & e : errors) {
        if (e) {
            std::rethrow_exception(e);
        }
    }
    cell.wall_s = std::chrono::duration<double>(end - start).count();
    cell.latency_us.reserve((size_t) cell.n_requests);
    for (int t = 0; t < concurrency; ++t) {
        cell.latency_us.insert(cell.latency_us.end(), lat[(size_t) t].begin(), lat[(size_t) t].end());
        cell.total_bytes += bytes[(size_t) t];
    }
    return cell;
}
