// Device I/O probe: random aligned reads of one size from one file, issued by N native threads.
//
// Invariant: a probe cell measures the device, not the page cache and not Python. Every request is
// a pread of one 4096-aligned offset drawn uniformly (seeded) from the file, into a 4096-aligned
// buffer, timed alone with steady_clock; with O_DIRECT the page cache is bypassed, and with
// drop_cache the file's cached pages are dropped (POSIX_FADV_DONTNEED) before each cell. The
// mode that actually ran ("direct" or "buffered") is always reported, never assumed. A failed or
// short read becomes an IoProbeError carrying file, offset and errno; nothing here aborts the
// process.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

// A read (or open / fadvise) that failed. errno_value is the errno; offset is -1 when not a read.
struct IoProbeError : std::runtime_error {
    IoProbeError(const std::string & path, int64_t offset, int errno_value, const std::string & what);
    std::string path;
    std::string detail;  // the message without the leading "path: "
    int64_t     offset;
    int         errno_value;
};

// One (request size, concurrency) measurement.
struct IoProbeCell {
    int64_t             request_bytes;   // size asked for
    int64_t             read_bytes;      // size issued per pread (request_bytes rounded up to 4096 with O_DIRECT)
    int32_t             concurrency;     // worker threads, each with one request in flight
    int64_t             n_requests;      // total requests = concurrency * requests per thread
    int64_t             total_bytes;     // bytes actually transferred (sum of pread results)
    double              wall_s;          // from the common start to the last thread's last completion
    std::vector<double> latency_us;      // per request, in completion order within each thread
};

// An open file plus the I/O mode chosen for it. Thread-safe for reads (pread on a shared fd).
class IoProbe {
public:
    // Opens path read-only. want_direct: try O_DIRECT, falling back to buffered I/O when the open
    // or a first 4096-byte read at offset 0 fails with EINVAL (tmpfs, some FUSE/overlay mounts).
    IoProbe(const std::string & path, bool want_direct);
    ~IoProbe();
    IoProbe(const IoProbe &) = delete;
    IoProbe & operator=(const IoProbe &) = delete;

    // Runs one cell: `concurrency` threads each issue `requests_per_thread` reads of
    // `request_bytes` at random 4096-aligned offsets in [0, file_size - request_bytes].
    // Throws std::invalid_argument for bad arguments (file smaller than request_bytes included)
    // and IoProbeError for failed I/O.
    IoProbeCell run(int64_t request_bytes, int32_t concurrency, int64_t requests_per_thread,
                    uint64_t seed, bool drop_cache);

    // Drops the file's pages from the page cache (posix_fadvise DONTNEED over the whole file).
    void drop_cache();

    const std::string & path() const { return path_; }
    int64_t file_size() const { return file_size_; }
    bool direct() const { return direct_; }
    const char * mode() const { return direct_ ? "direct" : "buffered"; }

private:
    std::string path_;
    int         fd_        = -1;
    int64_t     file_size_ = 0;
    bool        direct_    = false;
};

constexpr int64_t IO_PROBE_ALIGN = 4096;
