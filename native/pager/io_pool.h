// io_pool: a fixed set of worker threads that execute positioned reads from file descriptors
// into caller-owned memory, taken from one queue of jobs: in order, except that a caller may put
// jobs at the front or promote queued ones, and that at most background_limit background jobs
// run at once (a worker passes over the others). A read whose destination lies in a registered
// buffer in use is an io_uring READ_FIXED on the reading thread's own ring (use_fixed_buffers),
// any other a pread; both loop over partial reads the same way.
//
// Invariant: a job handed to the pool is finished exactly once (read, failed, or cancelled
// before a worker claimed it), its result (bytes read, errno, duration) is written before it
// counts as done, and every wait returns only after all the jobs it names are done; no job
// outlives the wait that covers it, so the caller may unmap or reuse the destination memory
// afterwards. A job never retries silently: a short read that ends before `need` bytes is
// reported as a failure with err = 0 and got < need, and the caller decides what that means.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "uring.h"

int64_t io_now_us();

struct io_job {
    int64_t  offset = 0;   // file offset, bytes (page-aligned for O_DIRECT)
    int64_t  len    = 0;   // bytes to request (page multiple for O_DIRECT)
    int64_t  need   = 0;   // bytes that must arrive for success (<= len; the rest may be past EOF)
    void *   dst    = nullptr;  // where the bytes go, or (out_fd >= 0) nothing:
    int      out_fd = -1;       // ... they are written to this file (the arena memfd) at out_off, through the
    int64_t  out_off = 0;       //     reading thread's bounce buffer (kBounceBytes), so no mapping of it is touched
    int      fd     = -1;  // file to read (a model may be split over several); -1 = the batch's fd
    int      tag    = 0;   // caller's label (the pager: the unit), for cancel_pending
    bool     cancel = false;  // set by cancel_pending before a worker claimed it: not read, err = ECANCELED
    bool     notify = false;  // call the pool's continuation (set_after) when finished
    bool     cancelable = false;  // cancel_pending may cancel it (speculative reads only)
    bool     dontneed = false;    // drop the read range from the page cache afterwards (set by run/enqueue)
    bool     background = false;  // deep speculation: at most background_limit such jobs run at once
    // Run by the thread that executes the job, before the read and outside the device-busy clock;
    // not run for a cancelled job. The pager uses it to unmap the destination slot's previous
    // occupant (its evicted expert) off the compute thread. Must not throw or call into the pool.
    std::function<void()> before;
    // results
    bool     done   = false;  // finished (under the pool's lock)
    int64_t  got    = 0;   // bytes read
    int      err    = 0;   // errno of a failed read, 0 otherwise
    int64_t  t_us   = 0;   // wall time of this job's reads, microseconds
};

// Bytes of each reading thread's bounce buffer (jobs with out_fd; allocated at its first such job).
inline constexpr int64_t kBounceBytes = 1 << 20;

class io_pool {
public:
    explicit io_pool(int n_threads);
    ~io_pool();
    io_pool(const io_pool &) = delete;
    io_pool & operator=(const io_pool &) = delete;

    // Executes all jobs on the workers, queued ahead of every job already queued (or inline when
    // there is one job or one thread and nothing is queued), reading with pread from each job's fd (fd when the job has none);
    // when dontneed is set, drops the read range from the page cache afterwards (buffered
    // mode). Blocks until every job of it is done.
    void run(int fd, bool dontneed, std::vector<io_job> & jobs);

    int n_threads() const { return (int) workers_.size(); }

    // Asynchronous jobs: appends jobs to the queue and returns at once. The jobs must stay alive
    // and unresized until a wait covering them returned. Jobs run in queue order (FIFO), so
    // what is enqueued first is read first.
    void enqueue(int fd, bool dontneed, std::vector<io_job> & jobs) { enqueue(fd, dontneed, jobs, 0, jobs.size(), false); }
    // The same for jobs[from, to); front: ahead of every job still queued (in their order), for
    // reads the caller is about to wait for while speculative ones are queued.
    void enqueue(int fd, bool dontneed, std::vector<io_job> & jobs, size_t from, size_t to, bool front);
    // Blocks until every job in jobs[from, to) is done.
    void wait_jobs(std::vector<io_job> & jobs, size_t from, size_t to);
    // The continuation called on the worker right after each job with notify set, outside the
    // pool's lock and before the job counts as done, so a wait returns only after its calls
    // returned; it must not throw and must not call into the pool. Set it while idle.
    void set_after(std::function<void(io_job &)> after) { after_ = std::move(after); }

    // Cancels the queued cancelable jobs no worker has claimed yet whose tag keep(tag) rejects;
    // returns how many (they finish at once with err = ECANCELED).
    template <class F> int cancel_pending(F keep) {
        std::lock_guard<std::mutex> lk(mu_);
        int n = 0;
        for (io_job * j : queue_)
            if (j->cancelable && !j->cancel && !keep(j->tag)) { j->cancel = true; n++; }
        if (n) cv_work_.notify_all();  // a cancelled background job is claimable beyond the limit
        return n;
    }
    // Moves the queued jobs whose tag pred(tag) accepts ahead of the others, each group keeping
    // its order, and makes them ordinary (not background): reads that became urgent (a
    // speculative read the caller now waits for).
    template <class F> void promote(F pred) {
        std::lock_guard<std::mutex> lk(mu_);
        auto mid = std::stable_partition(queue_.begin(), queue_.end(), [&](const io_job * j) { return pred(j->tag); });
        for (auto it = queue_.begin(); it != mid; ++it) (*it)->background = false;
        if (queue_.begin() != mid) cv_work_.notify_all();  // a worker held back by the background limit may take them
    }
    // Jobs queued or running.
    bool busy() {
        std::lock_guard<std::mutex> lk(mu_);
        return !queue_.empty() || running_ > 0;
    }

    // Wall time (µs) during which at least one read of this pool was in progress, since the pool
    // started: the device's busy time as the reads see it, whether or not anyone waited.
    int64_t busy_us() {
        std::lock_guard<std::mutex> lk(mu_);
        return busy_us_ + (active_ > 0 ? io_now_us() - busy_since_ : 0);
    }

    // At most n background jobs run at once (a worker passes over queued background jobs beyond
    // that and takes the next other one), so deep speculation cannot occupy every thread when a
    // read that is waited for arrives. Set it while idle.
    void set_background_limit(int n) { bg_limit_ = n < 1 ? 1 : n; }

    // Test hook: every read (job) from now sleeps delay_us microseconds first (an artificially
    // slow device; its time is part of the job's t_us). 0 disables.
    void set_delay_us(int64_t delay_us) { delay_us_ = delay_us; }
    int64_t delay_us() const { return delay_us_; }

    // Bench hook: a device no faster than bytes_per_s, without burst credit. Reads are served one
    // at a time in the order they start, each taking its bytes / bytes_per_s on one shared device
    // clock: a read that starts while the clock is ahead of now queues behind it, and it completes
    // no earlier than its slot on the clock ends (nor than the real read does). A blkio throttle is
    // not such a device: it grants a group that was idle a slice's worth of bytes at once, which
    // favours bursty reads. 0 disables.
    void set_rate_limit(int64_t bytes_per_s) {
        std::lock_guard<std::mutex> lk(rate_mu_);
        rate_ = bytes_per_s > 0 ? bytes_per_s : 0;
        dev_free_us_ = 0;
    }
    int64_t rate_limit() const { return rate_.load(); }

    // Test hook: the n-th read from now (1-based) fails with errno err. 0 disables.
    void inject_fault(int64_t nth, int err);

    // Reads into registered buffers (docs/DESIGN.md §3e): gives every reading thread (each worker,
    // and the caller of run's inline path) an io_uring with bufs (address, bytes; address-sorted,
    // disjoint) registered, so a read whose destination lies inside one is a READ_FIXED, which does
    // not pin its pages again; other reads stay pread. "" or why not (then everything stays pread).
    // Call while idle, at most once.
    std::string use_fixed_buffers(const std::vector<std::pair<char *, int64_t>> & bufs);
    // Takes buffer i out of use (on = false: its pages are unpinned and may be punched out) or
    // registers it again (on = true: its pages are pinned as they are now). No read into buffer i
    // may be in flight. Returns 0 or -errno of the first ring that refused (the buffer stays out).
    int set_fixed_buffer(int i, bool on);
    // Reads done through registered buffers / with pread since the pool started.
    int64_t fixed_reads() const { return fixed_reads_.load(); }
    int64_t plain_reads() const { return plain_reads_.load(); }

private:
    void worker(int index);
    void stop_workers();  // sets stop_, wakes and joins every started worker
    void exec(io_job & j, int ring);  // ring: the reading thread's (worker index, or n_threads for run's inline path)
    bool read_fixed(io_job & j, int ring);  // a READ_FIXED loop when j.dst lies in a buffer in use; false: not taken
    void exec_bounced(io_job & j);

    std::vector<std::thread> workers_;
    std::mutex               mu_;
    std::condition_variable  cv_work_;
    std::condition_variable  cv_done_;
    std::deque<io_job *>     queue_;       // not yet claimed, FIFO
    int                      running_  = 0;  // claimed, not done
    int                      bg_running_ = 0;  // ... of them background
    int                      bg_limit_ = 1;
    std::deque<io_job *>::iterator next_job();  // first queued job a worker may claim now (under mu_), or end
    int                      active_   = 0;  // jobs being read now (workers and inline), for busy_us
    int64_t                  busy_since_ = 0, busy_us_ = 0;
    void begin_read();  // active_++ (under mu_)
    void end_read();    // active_-- (under mu_)
    bool                     stop_     = false;
    std::function<void(io_job &)> after_;
    int64_t                  fault_countdown_ = 0;
    int                      fault_err_       = 0;
    int64_t                  delay_us_        = 0;
    std::mutex               rate_mu_;
    std::atomic<int64_t>     rate_{0};
    int64_t                  dev_free_us_ = 0;  // set_rate_limit's device clock (under rate_mu_)
    // use_fixed_buffers: one ring per reading thread, the buffers' bounds and whether each is in use
    std::vector<std::unique_ptr<uring>> rings_;
    std::vector<char *>      buf_lo_, buf_hi_;
    std::unique_ptr<std::atomic<bool>[]> buf_on_;
    std::atomic<int64_t>     fixed_reads_{0}, plain_reads_{0};
    void pace(int64_t t_start, int64_t bytes);             // sleeps until the read's slot on it ends
};

