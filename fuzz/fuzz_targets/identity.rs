#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| gaps_fuzz::identity(data));
