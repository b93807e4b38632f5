#![no_main]
// The core with a twin whose dense state is resident in the device executor's host arenas: besides the
// core's own invariants, every reply and checkpoint of the two must agree.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    gaps_fuzz::shard_core_resident(data);
});
