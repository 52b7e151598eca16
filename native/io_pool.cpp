// io_pool: worker threads executing positioned reads; see io_pool.h for the invariant.
// A batch is handed to the workers under one mutex; each worker claims the next job index,
// reads it with pread (looping over partial reads until EOF, error or len), records the
// result in the job itself, and counts it done. run() waits for done == size.
#include "io_pool.h"

#include <cerrno>
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
    } else {
        char * dst = (char *) j.dst;
        const int fd = j.fd >= 0 ? j.fd : fd_;
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
        if (dontneed_ && j.got > 0) {
            posix_fadvise(fd, (off_t) j.offset, (off_t) j.got, POSIX_FADV_DONTNEED);
        }
    }
    j.t_us = io_now_us() - t0;
}

void io_pool::worker() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
        cv_work_.wait(lk, [this] { return stop_ || (batch_ && next_ < batch_->size()); });
        if (stop_) return;
        io_job & j = (*batch_)[next_++];
        const bool skip = j.cancel;  // read under the lock: cancel_pending sets it under the lock
        lk.unlock();
        if (skip) {
            j.got = 0;
            j.err = ECANCELED;
            j.t_us = 0;
        } else {
            exec(j);
        }
        if (after_) after_(j);  // set before the batch was published, cleared after it is done
        lk.lock();
        if (++done_ == batch_->size()) cv_done_.notify_all();
    }
}

void io_pool::run(int fd, bool dontneed, std::vector<io_job> & jobs) {
    if (jobs.empty()) return;
    after_ = nullptr;  // no batch is in flight (see submit): no worker reads it now
    fd_       = fd;
    dontneed_ = dontneed;
    if (jobs.size() == 1 || workers_.size() == 1) {
        // One job or one worker: read on the calling thread, saving two context switches.
        for (auto & j : jobs) exec(j);
        return;
    }
    std::unique_lock<std::mutex> lk(mu_);
    batch_ = &jobs;
    next_  = 0;
    done_  = 0;
    cv_work_.notify_all();
    cv_done_.wait(lk, [&] { return done_ == jobs.size(); });
    batch_ = nullptr;
}

void io_pool::submit(int fd, bool dontneed, std::vector<io_job> & jobs, std::function<void(io_job &)> after) {
    if (batch_) throw std::logic_error("io_pool::submit while a batch is in flight");
    if (jobs.empty()) return;
    std::lock_guard<std::mutex> lk(mu_);
    after_    = std::move(after);
    fd_       = fd;
    dontneed_ = dontneed;
    batch_    = &jobs;
    next_     = 0;
    done_     = 0;
    cv_work_.notify_all();
}

void io_pool::wait() {
    if (!batch_) return;
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return done_ == batch_->size(); });
    batch_ = nullptr;
    after_ = nullptr;
}
