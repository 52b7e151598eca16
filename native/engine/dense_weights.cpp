// dense_weights: in-place swap of llama's file-backed dense pages for anonymous copies
// (dense_weights.h states the invariant).
//
// Invariant kept here: a range is made read-only (and, with lock, mlock'ed) only after every byte
// of it that lies inside the file was read into it; a failed or short read throws instead (the
// engine then frees the model, so nothing computes on a half-filled range). A read that fails
// under O_DIRECT is redone once buffered, and a buffered read's pages are dropped from the page
// cache afterwards. The descriptor is closed on every path.
#include "dense_weights.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

static std::string errstr(int e) { return std::string(strerror(e)) + " (errno " + std::to_string(e) + ")"; }

// Reads [off, off+len) into dst (page-aligned), returns bytes read (short only at end of file).
static int64_t read_all(int fd, char * dst, int64_t off, int64_t len, const std::string & path) {
    const int64_t chunk = 16 << 20;
    int64_t got = 0;
    while (got < len) {
        const int64_t want = std::min(chunk, len - got);
        ssize_t r = pread(fd, dst + got, (size_t) want, (off_t) (off + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            const int e = errno;
            throw std::runtime_error("reading dense weights at offset " + std::to_string(off + got) + " of " + path + " failed: " + errstr(e));
        }
        if (r == 0) break;  // end of file
        got += r;
    }
    return got;
}

std::vector<std::pair<int64_t, int64_t>> still_mapped(const file_mapping & map) {
    std::vector<std::pair<int64_t, int64_t>> out;
    const uintptr_t ps = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t lo = (uintptr_t) map.addr, hi = lo + ((uintptr_t) map.length + ps - 1) / ps * ps;  // mmap maps whole pages
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line)) {
        // "start-end perms offset major:minor inode [path]", addresses and offset in hex, the device in hex
        std::istringstream in(line);
        std::string range, perms, off, dev;
        uint64_t ino = 0;
        if (!(in >> range >> perms >> off >> dev >> ino)) continue;
        const size_t dash = range.find('-'), colon = dev.find(':');
        if (dash == std::string::npos || colon == std::string::npos) continue;
        const uintptr_t a = (uintptr_t) std::stoull(range.substr(0, dash), nullptr, 16);
        const uintptr_t b = (uintptr_t) std::stoull(range.substr(dash + 1), nullptr, 16);
        const uint64_t d = makedev(std::stoul(dev.substr(0, colon), nullptr, 16), std::stoul(dev.substr(colon + 1), nullptr, 16));
        if (ino != map.ino || d != map.dev || b <= lo || a >= hi) continue;
        const uintptr_t x = std::max(a, lo), y = std::min(b, hi);
        out.emplace_back(map.offset + (int64_t) (x - lo), map.offset + (int64_t) (y - lo));
    }
    return out;
}

dense_report dense_to_anon(const std::string & path, const file_mapping & map,
                           std::vector<std::pair<int64_t, int64_t>> ranges, bool lock) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t ps = sysconf(_SC_PAGESIZE);
    // Widen to pages, clamp to what of llama's mapping is still mapped from the file, merge. llama.cpp unmaps the
    // pages before its first and after its last loaded tensor once the load is done (llama_model_loader::
    // load_all_data, unmap_fragment): a tensor it skipped there (an MTP block without load_mtp) is no longer
    // mapped, and an anonymous mapping put in its place would be nobody's to free (the pages leaked with every
    // model) or would overwrite whatever the process mapped there since.
    const std::vector<std::pair<int64_t, int64_t>> live = still_mapped(map);
    dense_report rep;
    std::vector<std::pair<int64_t, int64_t>> pages;
    for (auto & r : ranges) {
        if (r.second <= 0) continue;
        const int64_t a = (r.first / ps) * ps, b = ((r.first + r.second + ps - 1) / ps) * ps;
        int64_t kept = 0;
        for (const auto & m : live) {
            const int64_t x = std::max(a, m.first), y = std::min(b, m.second);
            if (y > x) {
                pages.emplace_back(x, y);
                kept += y - x;
            }
        }
        rep.bytes_unmapped += (b - a) - kept;
    }
    std::sort(pages.begin(), pages.end());
    std::vector<std::pair<int64_t, int64_t>> merged;
    for (auto & p : pages) {
        if (!merged.empty() && p.first <= merged.back().second) merged.back().second = std::max(merged.back().second, p.second);
        else merged.push_back(p);
    }

    int fd = open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
    rep.direct = fd >= 0;
    if (fd < 0) fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        const int e = errno;
        throw std::runtime_error("cannot open " + path + " to read its dense weights: " + errstr(e));
    }
    try {
        for (const auto & m : merged) {
            char * addr = (char *) map.addr + (m.first - map.offset);
            const int64_t len = m.second - m.first;
            void * r = mmap(addr, (size_t) len, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (r == MAP_FAILED) {
                const int e = errno;
                throw std::runtime_error("cannot map " + std::to_string(len) + " bytes of anonymous memory for dense weights: " + errstr(e));
            }
            int64_t got;
            try {
                got = read_all(fd, addr, m.first, len, path);
            } catch (const std::runtime_error &) {
                if (!rep.direct) throw;
                // A file system that accepts O_DIRECT at open may refuse the read: go buffered.
                close(fd);
                fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
                rep.direct = false;
                if (fd < 0) throw;
                got = read_all(fd, addr, m.first, len, path);
            }
            rep.bytes_read += got;
            const int64_t need = std::min(len, map.offset + map.length - m.first);  // bytes inside the file
            if (got < need) {
                throw std::runtime_error("short read of dense weights at offset " + std::to_string(m.first) + " of " + path + ": got " +
                                         std::to_string(got) + " of " + std::to_string(need) + " bytes (was the file truncated?)");
            }
            mprotect(addr, (size_t) len, PROT_READ);
            if (lock && mlock(addr, (size_t) len) != 0) {
                const int e = errno;
                struct rlimit rl{};
                getrlimit(RLIMIT_MEMLOCK, &rl);
                int64_t total = 0;
                for (const auto & x : merged) total += x.second - x.first;
                throw std::runtime_error("mlock of the dense weights failed: " + errstr(e) + ". They need " + std::to_string(total) +
                                         " bytes locked; RLIMIT_MEMLOCK is " +
                                         (rl.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : std::to_string((int64_t) rl.rlim_cur)) +
                                         " bytes. Raise it (ulimit -l, or LimitMEMLOCK= in systemd) or use dense_weights=\"anon\"");
            }
            rep.bytes += len;
            rep.ranges++;
        }
    } catch (...) {
        close(fd);
        throw;
    }
    if (!rep.direct) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
    rep.locked = lock;
    rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rep;
}
