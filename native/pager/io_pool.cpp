// io_pool: worker threads executing positioned reads; see io_pool.h for the invariant.
// Jobs are queued (pointers, FIFO) under one mutex; each worker claims the front job, reads it
// with pread (looping over partial reads until EOF, error or len), records the result in the
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
            workers_.emplace_back([this] { worker(); });
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

void io_pool::exec(io_job & j) {
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
    } else {
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

void io_pool::worker() {
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
            exec(j);
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
            exec(j);
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
