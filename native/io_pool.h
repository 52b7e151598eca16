// io_pool: a fixed set of worker threads that execute positioned reads from file descriptors
// (one per batch, or one per job) into caller-owned memory.
//
// Invariant: run() returns only after every job of the batch has finished, successfully or
// not, and each job's result (bytes read, errno, duration) is written exactly once; no job
// outlives the call, so the caller may unmap or reuse the destination memory afterwards.
// A job never retries silently: a short read that ends before `need` bytes is reported as
// a failure with err = 0 and got < need, and the caller decides what that means.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

struct io_job {
    int64_t  offset = 0;   // file offset, bytes (page-aligned for O_DIRECT)
    int64_t  len    = 0;   // bytes to request (page multiple for O_DIRECT)
    int64_t  need   = 0;   // bytes that must arrive for success (<= len; the rest may be past EOF)
    void *   dst    = nullptr;
    int      fd     = -1;  // file to read (a model may be split over several); -1 = run()'s fd
    int      tag    = 0;   // caller's label (the pager: the unit), for cancel_pending
    bool     cancel = false;  // set by cancel_pending before a worker claimed it: not read, err = ECANCELED
    // results
    int64_t  got    = 0;   // bytes read
    int      err    = 0;   // errno of a failed read, 0 otherwise
    int64_t  t_us   = 0;   // wall time of this job's reads, microseconds
};

class io_pool {
public:
    explicit io_pool(int n_threads);
    ~io_pool();
    io_pool(const io_pool &) = delete;
    io_pool & operator=(const io_pool &) = delete;

    // Executes all jobs on the workers (or inline when there is one job or one thread),
    // reading with pread from each job's fd (fd when the job has none); when dontneed is set, drops the read range from the page
    // cache afterwards (buffered mode). Blocks until every job is done.
    void run(int fd, bool dontneed, std::vector<io_job> & jobs);

    int n_threads() const { return (int) workers_.size(); }

    // Asynchronous batch (prefetch): hands jobs to the workers and returns at once; wait()
    // blocks until every job of it is done. jobs must stay alive and unresized until wait()
    // returned, and no run() or submit() may be issued meanwhile (the pager finishes a batch
    // before any other read). The invariant above holds at wait().
    // after (optional) runs on the worker right after each job of the batch, outside the pool's
    // lock and before the job counts as done, so wait() returns only after every call returned;
    // it must not throw and must not call into the pool.
    void submit(int fd, bool dontneed, std::vector<io_job> & jobs, std::function<void(io_job &)> after = nullptr);
    void wait();
    // Cancels the submitted jobs no worker has claimed yet whose tag keep(tag) rejects; returns
    // how many. Call between submit() and wait().
    template <class F> int cancel_pending(F keep) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!batch_) return 0;
        int n = 0;
        for (size_t i = next_; i < batch_->size(); i++)
            if (!(*batch_)[i].cancel && !keep((*batch_)[i].tag)) { (*batch_)[i].cancel = true; n++; }
        return n;
    }
    bool busy() const { return batch_ != nullptr; }

    // Test hook: every read (job) from now sleeps delay_us microseconds first (an artificially
    // slow device; its time is part of the job's t_us). 0 disables.
    void set_delay_us(int64_t delay_us) { delay_us_ = delay_us; }
    int64_t delay_us() const { return delay_us_; }

    // Test hook: the n-th read from now (1-based) fails with errno err. 0 disables.
    void inject_fault(int64_t nth, int err);

private:
    void worker();
    void stop_workers();  // sets stop_, wakes and joins every started worker
    void exec(io_job & j);

    std::vector<std::thread> workers_;
    std::mutex               mu_;
    std::condition_variable  cv_work_;
    std::condition_variable  cv_done_;
    std::vector<io_job> *    batch_    = nullptr;
    std::function<void(io_job &)> after_;  // the async batch's per-job continuation (submit)
    size_t                   next_     = 0;
    size_t                   done_     = 0;
    int                      fd_       = -1;
    bool                     dontneed_ = false;
    bool                     stop_     = false;
    int64_t                  fault_countdown_ = 0;
    int                      fault_err_       = 0;
    int64_t                  delay_us_        = 0;
};

int64_t io_now_us();
