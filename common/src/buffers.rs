//! A small recycler for large `f32` buffers.
//!
//! glibc serves allocations above its mmap threshold (at most 32 MiB) with a fresh `mmap` and returns them
//! to the kernel on `free`, so every multi-tensor round trip of a 16 Mi-float model (64 MiB payloads) paid
//! for its buffers four times over in page faults and page zeroing — 40 % of the process's time in the
//! transport bench. And a destination that must be sized before it is written (a pull's snapshot) costs a
//! memset when it comes from the allocator (`calloc` of reused memory): 5 % of the CPU of a 1 Mi-float
//! round. Buffers at least [`MIN_RECYCLED_BYTES`] large are kept here when dropped through [`give`] and
//! handed out again by [`take`] and [`take_filled`] (as they are, no zero-fill), at most [`MAX_KEPT`] of
//! them and [`MAX_KEPT_BYTES`] in all, so the idle memory stays bounded. Smaller buffers go to the
//! allocator.

use std::sync::Mutex;

/// Buffers smaller than this are not kept (the allocator recycles them well, and zeroing them is cheap).
pub const MIN_RECYCLED_BYTES: usize = 1 << 20;
/// Buffers kept at most.
pub const MAX_KEPT: usize = 16;
/// Bytes kept at most.
pub const MAX_KEPT_BYTES: usize = 512 << 20;

static KEPT: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// A kept buffer whose capacity is between `len` and twice it, as it was given back (its old values).
fn kept_for(len: usize) -> Option<Vec<f32>> {
    if len * 4 < MIN_RECYCLED_BYTES {
        return None;
    }
    let mut kept = KEPT.lock().ok()?;
    let i = kept.iter().position(|b| b.capacity() >= len && b.capacity() <= len.saturating_mul(2))?;
    Some(kept.swap_remove(i))
}

/// An empty vector with room for at least `len` values: a kept buffer whose capacity is between `len`
/// and twice it when there is one, else a new allocation.
pub fn take(len: usize) -> Vec<f32> {
    match kept_for(len) {
        Some(mut buf) => {
            buf.clear();
            buf
        }
        None => Vec::with_capacity(len),
    }
}

/// `len` values that the caller overwrites in full before reading any: a kept buffer as it is (its old
/// values, resized to `len`, zero-filling only what it did not hold), else `vec![0.0; len]` (which the
/// allocator may get already zeroed from the kernel). A reused buffer costs no memset, for destinations
/// such as a pull's snapshot, where every element is written by a reply before the buffer is handed out.
pub fn take_filled(len: usize) -> Vec<f32> {
    match kept_for(len) {
        Some(mut buf) => {
            buf.resize(len, 0.0);
            buf
        }
        None => vec![0.0; len],
    }
}

/// Hands a buffer back for [`take`] to reuse (dropped when it is small or the recycler is full).
pub fn give(buf: Vec<f32>) {
    let bytes = buf.capacity() * 4;
    if bytes < MIN_RECYCLED_BYTES {
        return;
    }
    if let Ok(mut kept) = KEPT.lock() {
        let held: usize = kept.iter().map(|b| b.capacity() * 4).sum();
        if kept.len() < MAX_KEPT && held + bytes <= MAX_KEPT_BYTES {
            kept.push(buf);
        }
    }
}

/// A buffer that goes back to the recycler when dropped (for payloads handed to the transport).
#[derive(Debug, Default)]
pub struct Recycled(pub Vec<f32>);

impl AsRef<[f32]> for Recycled {
    fn as_ref(&self) -> &[f32] {
        &self.0
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        give(std::mem::take(&mut self.0));
    }
}

/// Bytes below which glibc serves an allocation from its heap once [`tune_allocator`] ran (glibc's largest
/// allowed mmap threshold on 64-bit hosts).
pub const MMAP_THRESHOLD: usize = 32 << 20;
/// Free bytes at the top of glibc's heap that it keeps rather than returning to the kernel, once
/// [`tune_allocator`] ran.
pub const TRIM_THRESHOLD: usize = 512 << 20;

/// Makes glibc keep the memory of freed transfer buffers for the next round instead of handing it back to
/// the kernel and faulting it in again. By default glibc maps every allocation above its (moving) mmap
/// threshold afresh and trims its heap's free top above twice that: a round of a bulk push and pull (many
/// buffers of 0.5–4 MiB: 16-bit payload conversions, quinn's received datagram batches) then spent 10–18 %
/// of the process's CPU in page faults and zeroing pages. With a fixed mmap threshold of
/// [`MMAP_THRESHOLD`] and a trim threshold of [`TRIM_THRESHOLD`], the heap keeps what it freed (the
/// process's resident memory stays at its peak use, at most `TRIM_THRESHOLD` above what it holds). Call it
/// first thing in `main`; elsewhere than glibc it does nothing.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: mallopt only changes two thresholds of the allocator, under its own lock.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int);
    }
}

/// Gives memory that is kept but not in use back to the kernel: the recycled buffers, and the free pages
/// of glibc's heap (`malloc_trim`, which [`tune_allocator`] otherwise leaves to keep them for the next
/// round). A shard calls it every few seconds, so a burst of large requests raises its resident memory for
/// that long only, and what it holds stays near what its budgets allow. Returns the recycled bytes dropped.
pub fn release_idle() -> usize {
    let dropped = KEPT
        .lock()
        .map(|mut kept| {
            let bytes = kept.iter().map(|b| b.capacity() * 4).sum();
            kept.clear();
            bytes
        })
        .unwrap_or(0);
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: malloc_trim only returns free heap pages to the kernel, under the allocator's own locks.
    unsafe {
        libc::malloc_trim(0);
    }
    dropped
}

/// The memory this process may use, in bytes: the machine's (`MemTotal` of `/proc/meminfo`), or the
/// cgroup's limit where one is set lower (a container's, `memory.max` or v1's `memory.limit_in_bytes`).
/// None where neither can be read (not Linux).
pub fn usable_memory() -> Option<u64> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
    })?;
    let limit = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .filter_map(|text| text.trim().parse::<u64>().ok())
        .min();
    Some(limit.map_or(total, |l| l.min(total)))
}

/// Buffers and bytes kept now (for tests and diagnostics).
pub fn kept() -> (usize, usize) {
    KEPT.lock().map(|k| (k.len(), k.iter().map(|b| b.capacity() * 4).sum())).unwrap_or((0, 0))
}

/// Asks the kernel to back the memory of `buffer` (its whole capacity) with transparent huge pages where
/// it can: a table far larger than the TLB's reach then costs one page walk per 2 MiB instead of one per
/// 4 KiB on random access — walks that, at one per row, queued behind each other and held back the
/// prefetches of a batch lookup. Linux only, for buffers of 2 MiB or more; a hint whose failure (a kernel
/// with huge pages off) changes nothing but speed.
pub fn advise_huge_pages<T>(buffer: &Vec<T>) {
    const HUGE: usize = 2 << 20;
    let bytes = buffer.capacity() * std::mem::size_of::<T>();
    if bytes < HUGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = buffer.as_ptr() as usize;
        let aligned = start.div_ceil(PAGE) * PAGE;
        let len = (start + bytes).saturating_sub(aligned) / PAGE * PAGE;
        #[allow(unsafe_code)]
        // SAFETY: madvise with MADV_HUGEPAGE only changes how the kernel backs pages of this process's own
        // mapping (the page-aligned part of the buffer's allocation, which it owns); it reads and writes no
        // memory and its failure is harmless.
        unsafe {
            libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
    }
}

/// Asks the kernel to move `elements` onto transparent huge pages now (`MADV_COLLAPSE`, Linux 6.1 and
/// later; only the 2 MiB-aligned pages wholly inside the slice): what its background merging (khugepaged)
/// does to memory advised by [`advise_huge_pages`] over minutes — by default it scans 16 MiB every 10 s —,
/// done at once for the price of a copy (0.5–1 GB/s on the development VM). For benchmarks that
/// measure a table as it runs once the kernel has merged its pages. The bytes merged (0 for a slice that
/// holds no whole huge page; pages never written are not merged); None where the kernel merged none of
/// them (older kernels, huge pages off, another system).
pub fn collapse_huge_pages<T>(elements: &[T]) -> Option<usize> {
    let start = elements.as_ptr() as usize;
    collapse_range(start, start + std::mem::size_of_val(elements))
}

/// [`collapse_huge_pages`] of the addresses `start..end` of this process, one 2 MiB page (x86-64's huge
/// page) at a time: the kernel fails a call if any page of its range could not be merged (one never
/// written, say, as the unused tail of a buffer's capacity) though it merges the others, so a page at a time
/// counts what was merged. The bytes merged; None where not one page of the range could be.
fn collapse_range(start: usize, end: usize) -> Option<usize> {
    const HUGE: usize = 2 << 20;
    let (first, last) = (start.div_ceil(HUGE) * HUGE, end / HUGE * HUGE);
    if last <= first {
        return Some(0);
    }
    #[cfg(target_os = "linux")]
    {
        /// `MADV_COLLAPSE` (include/uapi/asm-generic/mman-common.h).
        const MADV_COLLAPSE: libc::c_int = 25;
        let merged = (first..last)
            .step_by(HUGE)
            .filter(|&page| {
                #[allow(unsafe_code)]
                // SAFETY: MADV_COLLAPSE only changes how the kernel backs a page of this process's address
                // space: it copies the page's contents into a huge page, or fails and leaves them where they
                // are (an address not mapped, memory the kernel cannot merge); either way every byte keeps
                // its value, and no Rust reference to the range is made. Its effects are resident memory
                // (2 MiB pages whose unwritten parts are filled with zeros, what reading them gives anyway)
                // and a short hold of the process's memory-map lock while the page is copied.
                let done = unsafe { libc::madvise(page as *mut libc::c_void, HUGE, MADV_COLLAPSE) };
                done == 0
            })
            .count()
            * HUGE;
        (merged > 0).then_some(merged)
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// [`collapse_huge_pages`] over every mapping of this process advised for huge pages (`hg` among its
/// `VmFlags` in `/proc/self/smaps`: the buffers of [`advise_huge_pages`] — sparse tables' arrays, large
/// payloads): for a benchmark that runs shards in its own process and measures them as they run once the
/// kernel has merged their memory. A blocking call (seconds for gigabytes). The bytes merged; None where
/// the process's mappings cannot be read or the kernel merged none of them.
pub fn collapse_advised_memory() -> Option<usize> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut advised = Vec::new();
    let mut current = None;
    for line in smaps.lines() {
        if let Some(range) = smaps_range(line) {
            current = Some(range);
        } else if let (Some(flags), Some(range)) = (line.strip_prefix("VmFlags:"), current) {
            if flags.split_whitespace().any(|f| f == "hg") {
                advised.push(range);
            }
        }
    }
    let mut merged = None;
    for (from, to) in advised {
        // A mapping unmapped since the listing is not merged, and whatever is mapped there by then keeps its
        // contents either way.
        if let Some(done) = collapse_range(from, to) {
            merged = Some(merged.unwrap_or(0) + done);
        }
    }
    merged
}

/// The address range of a mapping from the first line of its entry in `/proc/<pid>/smaps`
/// (`7f01c0000000-7f01c1200000 rw-p …`); None for the lines after it, which start with a field name
/// (`AnonHugePages:   14336 kB`).
fn smaps_range(line: &str) -> Option<(usize, usize)> {
    let (from, to) = line.split_whitespace().next()?.split_once('-')?;
    Some((usize::from_str_radix(from, 16).ok()?, usize::from_str_radix(to, 16).ok()?))
}

/// Makes room in `buffer` for `additional` more elements as `Vec::reserve` does (doubling), but moves to
/// the larger allocation by copying into memory advised for huge pages ([`advise_huge_pages`]) before it is
/// touched: a reallocation in place keeps what was there on small pages (measured: a 10 M-row table whose
/// arrays all grew that way ended mostly on small pages and looked rows up at 0.45× the speed).
pub fn reserve_huge<T: Copy>(buffer: &mut Vec<T>, additional: usize) {
    let needed = buffer.len().saturating_add(additional);
    if needed <= buffer.capacity() {
        return;
    }
    let mut bigger = Vec::with_capacity(needed.max(buffer.capacity().saturating_mul(2)));
    advise_huge_pages(&bigger);
    bigger.extend_from_slice(buffer);
    *buffer = bigger;
}

/// Makes room in `buffer` for `additional` more elements with `Vec::reserve` (a large buffer is moved by
/// remapping its pages, not copied) and, when that moved it, advises the new allocation for huge pages
/// ([`advise_huge_pages`]): the pages touched from then on are huge ones, those moved over stay small until
/// the kernel merges them in the background. For buffers too large to copy on every doubling.
pub fn reserve_advised<T>(buffer: &mut Vec<T>, additional: usize) {
    let capacity = buffer.capacity();
    buffer.reserve(additional);
    if buffer.capacity() != capacity {
        advise_huge_pages(buffer);
    }
}

/// `n` copies of `value` in memory advised for huge pages ([`advise_huge_pages`]) before it is written.
pub fn filled_huge<T: Copy>(n: usize, value: T) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    advise_huge_pages(&v);
    v.resize(n, value);
    v
}

/// Asks the CPU to bring element `i` of `slice` into its caches (nothing when `i` is out of range, or off
/// x86-64): a lookup that will read it soon then finds it there instead of waiting for memory.
#[inline(always)]
pub fn prefetch<T>(slice: &[T], i: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(x) = slice.get(i) {
        #[allow(unsafe_code)]
        // SAFETY: a prefetch is only a hint (it never faults, reads nothing into the program and writes
        // nothing); SSE, which it needs, is part of every x86-64 CPU; the address is of a live element.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((x as *const T).cast());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (slice, i);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `AnonHugePages` of the mapping of this process that holds `address`, in kB.
    #[cfg(target_os = "linux")]
    fn huge_kb_at(address: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((from, to)) = smaps_range(line) {
                inside = (from..to).contains(&address);
                continue;
            }
            if let Some(kb) = line.strip_prefix("AnonHugePages:").filter(|_| inside) {
                return kb.trim().trim_end_matches("kB").trim().parse().expect("a size in kB");
            }
        }
        panic!("no mapping holds {address:#x}")
    }

    /// Makes a mapping of its own, 18 MiB, kept on small pages while it is written (MADV_NOHUGEPAGE, whatever
    /// the system's THP setting), then advised for huge pages, and has `merge` merge the 16 MiB slice that
    /// starts 1 MiB in: its whole 2 MiB pages (7 or 8, wherever the mapping starts) must be huge afterwards,
    /// and every value where it was. Whether `merge` did it (false: the kernel cannot).
    #[cfg(target_os = "linux")]
    fn merged_on_small_pages(merge: impl FnOnce(&[u64]) -> Option<usize>) -> bool {
        const LEN: usize = 18 << 20;
        const GUARD: usize = 4096;
        #[allow(unsafe_code)]
        // SAFETY: a fresh private anonymous mapping of LEN bytes between two inaccessible guard pages (so the
        // kernel cannot merge it with a neighbouring mapping, whose huge pages would then count as its own),
        // checked for failure; the slice over it below is the only access and ends before the munmap.
        let base = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                LEN + 2 * GUARD,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED, "mmap");
            assert_eq!(libc::mprotect(p, GUARD, libc::PROT_NONE), 0, "mprotect");
            assert_eq!(libc::mprotect(p.cast::<u8>().add(GUARD + LEN).cast(), GUARD, libc::PROT_NONE), 0, "mprotect");
            let base = p.cast::<u8>().add(GUARD).cast::<libc::c_void>();
            libc::madvise(base, LEN, libc::MADV_NOHUGEPAGE);
            base
        };
        #[allow(unsafe_code)]
        // SAFETY: `base` maps LEN bytes, page-aligned (so aligned for u64), readable and writable, zeroed.
        let all: &mut [u64] = unsafe { std::slice::from_raw_parts_mut(base.cast::<u64>(), LEN / 8) };
        let value = |i: usize| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        all.iter_mut().enumerate().for_each(|(i, x)| *x = value(i));
        let slice = &all[(1 << 20) / 8..(17 << 20) / 8];
        let address = slice.as_ptr() as usize;
        assert_eq!(huge_kb_at(address), 0, "written under MADV_NOHUGEPAGE, yet on huge pages");
        #[allow(unsafe_code)]
        // SAFETY: replaces the NOHUGEPAGE advice of this test's own mapping; changes no memory.
        unsafe {
            libc::madvise(base, LEN, libc::MADV_HUGEPAGE);
        }
        let merged = merge(slice);
        if let Some(bytes) = merged {
            assert!(bytes >= 14 << 20, "{bytes} bytes merged");
            assert!(huge_kb_at(address) >= 14 << 10, "merged, yet the mapping holds fewer huge pages");
        }
        assert!(all.iter().enumerate().all(|(i, x)| *x == value(i)), "a value moved");
        #[allow(unsafe_code)]
        // SAFETY: the mapping made above with its guard pages, no longer borrowed.
        unsafe {
            libc::munmap(base.cast::<u8>().sub(GUARD).cast(), LEN + 2 * GUARD);
        }
        merged.is_some()
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn collapsing_a_buffer_onto_huge_pages_keeps_its_contents() {
        if !merged_on_small_pages(collapse_huge_pages) {
            // The kernel cannot (before 6.1, THP compiled out or disabled for the process): only the contents
            // were checked.
            eprintln!("MADV_COLLAPSE is not available here");
        }
        // Slices holding no whole huge page ask nothing.
        assert_eq!(collapse_huge_pages(&[0u64; 1000]), Some(0));
        assert_eq!(collapse_huge_pages::<u64>(&[]), Some(0));
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn collapsing_the_advised_memory_merges_every_advised_mapping() {
        // Where the kernel merges a slice it is asked to, it must merge the advised mappings too.
        let kernel_merges = merged_on_small_pages(collapse_huge_pages);
        let merged = merged_on_small_pages(|_| collapse_advised_memory());
        assert_eq!(merged, kernel_merges, "the advised mappings were not merged where the kernel can");
    }

    #[test]
    fn buffers_grown_for_huge_pages_keep_their_contents() {
        let mut v: Vec<u64> = (0..1000).collect();
        reserve_huge(&mut v, 1 << 20);
        assert!(v.capacity() >= 1000 + (1 << 20));
        assert_eq!(v, (0..1000).collect::<Vec<_>>());
        let capacity = v.capacity();
        reserve_huge(&mut v, 10);
        assert_eq!(v.capacity(), capacity, "room enough: nothing moves");
        let mut w: Vec<u32> = (0..1000).collect();
        reserve_advised(&mut w, 1 << 20);
        assert!(w.capacity() >= 1000 + (1 << 20) && w == (0..1000).collect::<Vec<_>>());
        let f = filled_huge(3 << 20, u32::MAX);
        assert!(f.len() == 3 << 20 && f.iter().all(|x| *x == u32::MAX));
    }

    #[test]
    fn large_buffers_are_reused_and_the_kept_memory_is_bounded() {
        let big = MIN_RECYCLED_BYTES / 4;
        give(vec![0.0; 10]);
        assert_eq!(kept().0, 0, "small buffers are not kept");
        let a = take(big);
        let ptr = a.as_ptr();
        give(a);
        let b = take(big);
        assert_eq!(b.as_ptr(), ptr, "the same buffer comes back");
        assert!(b.is_empty() && b.capacity() >= big);
        let c = take(big * 3);
        assert_ne!(c.as_ptr(), ptr, "a buffer too small for the request is not handed out");
        give(b);
        assert!(take(big / 4).capacity() < big, "a buffer more than twice as large is not handed out");
        for _ in 0..(MAX_KEPT + 3) {
            give(Vec::with_capacity(big));
        }
        let (n, bytes) = kept();
        assert!(n <= MAX_KEPT && bytes <= MAX_KEPT_BYTES, "{n} buffers, {bytes} bytes kept");
        drop(c);
    }
}
