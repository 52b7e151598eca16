// io_pool: worker threads executing positioned reads; see io_pool.h for the invariant.
// Jobs are queued (pointers, FIFO) under one mutex; each worker claims the front job, reads it
// with io_uring READ_FIXED or pread (looping over partial reads until EOF, error or len), records the result in the
// job itself, and marks it done under the mutex. A wait sleeps until its jobs are all done.
#include "io_pool.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <chrono>
#include <stdexcept>
#include <string>
#include <system_error>
#include <climits>
#include <fcntl.h>
#include <unistd.h>

int64_t io_now_us() {
    using namespace std::chrono;
    return duration_cast<microseconds>(steady_clock::now().time_since_epoch()).count();
}

io_pool::io_pool(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    for (int i = 0; i < n_threads; i++) {
        try {
            workers_.emplace_back([this, i] { worker(i); });
        } catch (const std::system_error & e) {
            // Thread or address-space limit: stop and join the workers already started (a
            // joinable std::thread destroyed would terminate the process), then report.
            stop_workers();
            throw std::runtime_error("cannot start I/O thread " + std::to_string(i + 1) + " of " + std::to_string(n_threads) +
                                     ": " + e.what() + "; use fewer io_threads or raise the process's thread limit");
        }
    }
}

void io_pool::stop_workers() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
    }
    cv_work_.notify_all();
    for (auto & t : workers_)
        if (t.joinable()) t.join();
    workers_.clear();
}

io_pool::~io_pool() { stop_workers(); }

void io_pool::inject_fault(int64_t nth, int err) {
    std::lock_guard<std::mutex> lk(mu_);
    fault_countdown_ = nth;
    fault_err_       = err;
}

std::string io_pool::use_fixed_buffers(const std::vector<std::pair<char *, int64_t>> & bufs) {
    if (!rings_.empty()) return "already in use";
    if (bufs.empty()) return "no buffers";
    std::vector<std::unique_ptr<uring>> rings;
    for (size_t i = 0; i <= workers_.size(); i++) {
        auto r = std::make_unique<uring>();
        std::string why = r->init();
        // the first ring pins the buffers; the others share its table where the kernel can
        if (why.empty() && (i == 0 || !r->clone_buffers(*rings[0]).empty())) why = r->register_buffers(bufs);
        if (!why.empty()) return why;
        rings.push_back(std::move(r));
    }
    buf_lo_.clear();
    buf_hi_.clear();
    for (const auto & b : bufs) {
        buf_lo_.push_back(b.first);
        buf_hi_.push_back(b.first + b.second);
    }
    buf_on_.reset(new std::atomic<bool>[bufs.size()]);
    for (size_t i = 0; i < bufs.size(); i++) buf_on_[i] = bufs[i].first != nullptr;
    std::lock_guard<std::mutex> lk(mu_);  // published before any job that may use them is queued
    rings_ = std::move(rings);
    return "";
}

int io_pool::set_fixed_buffer(int i, bool on) {
    if (rings_.empty() || i < 0 || i >= (int) buf_lo_.size()) return -EINVAL;
    if (!on) buf_on_[i].store(false, std::memory_order_release);  // before its pages are unpinned
    for (auto & r : rings_) {
        const int e = r->update_buffer(i, on ? buf_lo_[i] : nullptr, buf_hi_[i] - buf_lo_[i]);
        if (e != 0) {
            buf_on_[i].store(false, std::memory_order_release);
            for (auto & r2 : rings_) r2->update_buffer(i, nullptr, 0);  // out of use everywhere
            return e;
        }
    }
    if (on) buf_on_[i].store(true, std::memory_order_release);  // after every ring pinned it
    return 0;
}

bool io_pool::read_fixed(io_job & j, int ring) {
    if (rings_.empty() || j.dontneed || ring < 0 || ring >= (int) rings_.size() || !rings_[ring]->ok()) return false;
    char * dst = (char *) j.dst;
    const auto it = std::upper_bound(buf_lo_.begin(), buf_lo_.end(), dst);
    if (it == buf_lo_.begin()) return false;
    const int b = (int) (it - buf_lo_.begin()) - 1;
    if (dst + j.len > buf_hi_[b] || !buf_on_[b].load(std::memory_order_acquire)) return false;
    while (j.got < j.len) {
        const int64_t want = std::min<int64_t>(j.len - j.got, 1 << 30);
        const int64_t r = rings_[ring]->read_fixed(j.fd, dst + j.got, want, j.offset + j.got, b);
        if (r == INT64_MIN) return false;  // the ring failed: pread reads the rest (from j.got)
        if (r < 0) {
            if (r == -EINTR || r == -EAGAIN) continue;
            j.err = (int) -r;
            break;
        }
        if (r == 0) break;  // EOF
        j.got += r;
    }
    return true;
}

void io_pool::exec(io_job & j, int ring) {
    int forced = 0;
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (fault_countdown_ > 0 && --fault_countdown_ == 0) forced = fault_err_;
    }
    const int64_t t0 = io_now_us();
    j.got = 0;
    j.err = 0;
    if (delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
    if (forced) {
        j.err = forced;
    } else if (j.out_fd >= 0) {
        exec_bounced(j);
        plain_reads_++;
    } else if (read_fixed(j, ring)) {
        fixed_reads_++;
    } else {
        plain_reads_++;
        char * dst = (char *) j.dst;
        const int fd = j.fd;
        while (j.got < j.len) {
            ssize_t r = pread(fd, dst + j.got, (size_t) (j.len - j.got), (off_t) (j.offset + j.got));
            if (r < 0) {
                if (errno == EINTR) continue;
                j.err = errno;
                break;
            }
            if (r == 0) break;  // EOF
            j.got += r;
        }
        if (j.dontneed && j.got > 0) {
            posix_fadvise(fd, (off_t) j.offset, (off_t) j.got, POSIX_FADV_DONTNEED);
        }
    }
    if (rate_ > 0 && j.got > 0) pace(t0, j.got);
    j.t_us = io_now_us() - t0;
}

void io_pool::pace(int64_t t_start, int64_t bytes) {
    int64_t end;
    {
        std::lock_guard<std::mutex> lk(rate_mu_);
        if (rate_ <= 0) return;
        const int64_t start = std::max(t_start, dev_free_us_);
        end = start + bytes * 1000000 / rate_;
        dev_free_us_ = end;
    }
    const int64_t now = io_now_us();
    if (end > now) std::this_thread::sleep_for(std::chrono::microseconds(end - now));
}

// A job whose destination is a file (the arena memfd): read kBounceBytes at a time into this
// thread's page-aligned bounce buffer (O_DIRECT-safe), then pwrite it to out_fd. No user mapping
// of the destination is faulted in or zapped, so no other core's TLB is shot down.
void io_pool::exec_bounced(io_job & j) {
    struct freer { void operator()(void * p) const { free(p); } };
    thread_local std::unique_ptr<char, freer> buf;
    if (!buf) {
        void * p = nullptr;
        if (posix_memalign(&p, 4096, (size_t) kBounceBytes) != 0) {
            j.err = ENOMEM;
            return;
        }
        buf.reset((char *) p);
    }
    const int fd = j.fd;
    while (j.got < j.len && !j.err) {
        const int64_t want = std::min<int64_t>(kBounceBytes, j.len - j.got);
        int64_t have = 0;
        while (have < want) {
            ssize_t r = pread(fd, buf.get() + have, (size_t) (want - have), (off_t) (j.offset + j.got + have));
            if (r < 0) {
                if (errno == EINTR) continue;
                j.err = errno;
                break;
            }
            if (r == 0) break;  // EOF
            have += r;
        }
        for (int64_t w = 0; w < have;) {
            ssize_t r = pwrite(j.out_fd, buf.get() + w, (size_t) (have - w), (off_t) (j.out_off + j.got + w));
            if (r <= 0) {
                if (r < 0 && errno == EINTR) continue;
                j.err = r < 0 ? errno : EIO;  // a memfd never takes 0 bytes; do not spin on it
                have = w;
                break;
            }
            w += r;
        }
        j.got += have;
        if (have < want) break;  // EOF or an error
    }
    if (j.dontneed && j.got > 0) posix_fadvise(fd, (off_t) j.offset, (off_t) j.got, POSIX_FADV_DONTNEED);
}

void io_pool::begin_read() {
    if (active_++ == 0) busy_since_ = io_now_us();
}

void io_pool::end_read() {
    if (--active_ == 0) busy_us_ += io_now_us() - busy_since_;
}

std::deque<io_job *>::iterator io_pool::next_job() {
    if (bg_running_ < bg_limit_) return queue_.begin();
    for (auto it = queue_.begin(); it != queue_.end(); ++it)
        if (!(*it)->background || (*it)->cancel) return it;  // a cancelled job reads nothing: take it
    return queue_.end();
}

void io_pool::worker(int index) {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
        cv_work_.wait(lk, [this] { return stop_ || next_job() != queue_.end(); });
        if (stop_) return;
        const auto it = next_job();
        io_job & j = **it;
        queue_.erase(it);
        running_++;
        const bool bg = j.background && !j.cancel;
        bg_running_ += bg;
        const bool skip = j.cancel;  // read under the lock: cancel_pending sets it under the lock
        if (!skip && j.before) {
            lk.unlock();
            j.before();
            lk.lock();
        }
        if (!skip) begin_read();
        lk.unlock();
        if (skip) {
            j.got = 0;
            j.err = ECANCELED;
            j.t_us = 0;
        } else {
            exec(j, index);
        }
        lk.lock();
        if (!skip) end_read();
        lk.unlock();
        if (j.notify && after_) after_(j);
        lk.lock();
        j.done = true;
        running_--;
        bg_running_ -= bg;
        cv_done_.notify_all();
        if (bg) cv_work_.notify_all();  // a background job may be claimable now
    }
}

void io_pool::run(int fd, bool dontneed, std::vector<io_job> & jobs) {
    if (jobs.empty()) return;
    for (auto & j : jobs) {
        j.done = false;
        j.notify = false;
        j.cancelable = false;
        j.background = false;
        j.dontneed = dontneed;
        if (j.fd < 0) j.fd = fd;
    }
    if ((jobs.size() == 1 || workers_.size() == 1) && !busy()) {
        // One job or one worker, nothing queued: read on the calling thread, saving two context switches.
        for (auto & j : jobs) {
            if (j.before) j.before();
            {
                std::lock_guard<std::mutex> lk(mu_);
                begin_read();
            }
            exec(j, (int) workers_.size());
            std::lock_guard<std::mutex> lk(mu_);
            end_read();
            j.done = true;
        }
        return;
    }
    enqueue(fd, dontneed, jobs, 0, jobs.size(), true);  // waited for now: ahead of queued speculation
    wait_jobs(jobs, 0, jobs.size());
}

void io_pool::enqueue(int fd, bool dontneed, std::vector<io_job> & jobs, size_t from, size_t to, bool front) {
    to = std::min(to, jobs.size());
    if (from >= to) return;
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<io_job *> add;
    for (size_t i = from; i < to; i++) {
        io_job & j = jobs[i];
        j.done = false;
        j.dontneed = dontneed;
        if (j.fd < 0) j.fd = fd;
        add.push_back(&j);
    }
    queue_.insert(front ? queue_.begin() : queue_.end(), add.begin(), add.end());
    cv_work_.notify_all();
}

void io_pool::wait_jobs(std::vector<io_job> & jobs, size_t from, size_t to) {
    std::unique_lock<std::mutex> lk(mu_);
    for (size_t i = from; i < to && i < jobs.size(); i++) {
        io_job & j = jobs[i];
        cv_done_.wait(lk, [&] { return j.done; });
    }
}
