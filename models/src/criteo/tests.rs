use super::*;

fn line(fields: &[&str]) -> String {
    fields.join("\t")
}

fn full() -> Vec<String> {
    let mut f = vec!["1".to_string()];
    f.extend((0..NUM_INT).map(|j| (j as i64 - 3).to_string()));
    f.extend((0..NUM_CAT).map(|c| format!("{:08x}", 0x1000_0000u32 + c as u32)));
    f
}

#[test]
fn tricky_lines_parse_or_fail_with_their_line_number() {
    let good = full();
    let refs: Vec<&str> = good.iter().map(String::as_str).collect();
    let s = parse_line(&line(&refs), 1).expect("a full line");
    assert_eq!(s.label, 1);
    assert_eq!(s.ints[0], -3, "negative integers");
    assert_eq!(s.cats[25], 0x1000_0019);
    assert_eq!(s.feature_id(2), Some(2u64 << 32 | 0x1000_0002));
    // Missing fields (empty) and a line that ends in a tab (the last categorical missing).
    let mut missing = refs.clone();
    missing[3] = "";
    missing[20] = "";
    missing[40 - 1] = "";
    let s = parse_line(&line(&missing), 2).expect("missing fields");
    assert_eq!(s.int_present & (1 << 2), 0);
    assert_eq!(s.cat_present & (1 << (20 - 14)), 0);
    assert_eq!(s.feature_id(25), None);
    assert!(line(&missing).ends_with('\t'));
    // An extra trailing tab after a complete line, and CRLF.
    assert_eq!(parse_line(&format!("{}\t", line(&refs)), 3).expect("trailing tab").cats[25], 0x1000_0019);
    assert_eq!(parse_line(&format!("{}\r", line(&refs)), 4).expect("CRLF").label, 1);
    // Too few fields, a non-hex categorical, a bad integer, a bad label, an over-long hash.
    let cases: Vec<(String, &str)> = vec![
        (line(&refs[..30]), "fields"),
        (line(&refs).replace("10000005", "1000zz05"), "hex"),
        (line(&refs).replacen("\t-3\t", "\t3.5\t", 1), "integer"),
        (line(&refs).replacen('1', "2", 1), "label"),
        (line(&refs).replace("10000005", "110000005"), "hex"),
    ];
    for (text, needle) in cases {
        let e = parse_line(&text, 77).expect_err(needle);
        assert_eq!(e.line, 77);
        assert!(e.reason.contains(needle), "{e}");
    }
}

#[test]
fn the_reader_streams_counts_bad_lines_and_never_stops_early() {
    let good = full().join("\t");
    let text = format!("{good}\r\nnot a line\n\n{good}\t\n1\t2\n\u{0}\u{1}garbage\n{good}");
    let mut reader = CriteoReader::new(std::io::Cursor::new(text.into_bytes()));
    let mut lines = Vec::new();
    while let Some((n, _)) = reader.next_sample() {
        lines.push(n);
    }
    assert_eq!(lines, vec![1, 4, 7]);
    assert_eq!(reader.bad_lines, 3);
    assert_eq!(reader.first_errors.iter().map(|e| e.line).collect::<Vec<_>>(), vec![2, 5, 6]);
    let invalid_utf8 = [good.as_bytes(), b"\n\xff\xfe\t\n", good.as_bytes()].concat();
    let mut reader = CriteoReader::new(std::io::Cursor::new(invalid_utf8));
    let mut n = 0;
    while reader.next_sample().is_some() {
        n += 1;
    }
    assert_eq!((n, reader.bad_lines), (2, 1));
}

#[test]
fn an_overlong_line_is_skipped_without_being_held_and_the_next_line_is_read() {
    // On d75cfe4 a 64 MiB line was read whole into memory.
    let good = full().join("\t");
    let huge = "7".repeat(8 * MAX_LINE_BYTES);
    let text = format!("{good}\n{huge}\n{good}\n{huge}");
    let mut reader = CriteoReader::new(std::io::BufReader::with_capacity(4096, std::io::Cursor::new(text)));
    let mut lines = Vec::new();
    while let Some((n, _)) = reader.next_sample() {
        lines.push(n);
        assert!(reader.bytes.capacity() <= 2 * MAX_LINE_BYTES, "the line buffer stays bounded");
    }
    assert_eq!(lines, vec![1, 3]);
    assert_eq!(reader.bad_lines, 2);
    assert!(reader.first_errors[0].reason.contains("longer than"), "{:?}", reader.first_errors);
}

#[test]
fn a_batch_that_starts_at_the_end_of_a_pass_is_not_an_error() {
    // On d75cfe4: 2,000 clean lines, one worker, batches of 200 — the 10th batch began exactly at the end
    // of the file and the stream reported "no usable training lines".
    let data = SyntheticCriteo::new(3);
    let text: String = (0..2000).map(|i| SyntheticCriteo::to_line(&data.sample(i).0) + "\n").collect();
    let path = std::env::temp_dir().join(format!("gaps-epoch-boundary-{}.tsv", std::process::id()));
    std::fs::write(&path, text).expect("write");
    let mut stream = TrainingStream::new(&DataSpec::Files(vec![path.clone()]), 0, 1).expect("stream");
    for batch in 0..40 {
        let b = stream.next_batch(200).unwrap_or_else(|e| panic!("batch {batch}: {e}"));
        assert_eq!(b.len(), 200);
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn synthetic_samples_round_trip_through_the_reader_and_the_teacher_is_informative() {
    let data = SyntheticCriteo::new(5);
    let mut probs = Vec::new();
    let mut labels = Vec::new();
    for i in 0..20_000 {
        let (s, p) = data.sample(i);
        if i < 50 {
            assert_eq!(parse_line(&SyntheticCriteo::to_line(&s), 1).expect("round trip"), s);
        }
        probs.push(p);
        labels.push(s.label);
    }
    assert_eq!(data.sample(7), data.sample(7));
    let ctr = labels.iter().map(|l| f64::from(*l)).sum::<f64>() / labels.len() as f64;
    assert!((0.15..0.5).contains(&ctr), "click rate {ctr}");
    let teacher = auc(&probs, &labels);
    assert!((0.7..0.95).contains(&teacher), "teacher AUC {teacher}");
}

#[test]
fn a_stream_with_epochs_ends_after_its_passes_and_synthetic_data_refuses_them() {
    let data = SyntheticCriteo::new(2);
    let text: Vec<String> = (0..50).map(|i| SyntheticCriteo::to_line(&data.sample(i).0)).collect();
    let path = std::env::temp_dir().join(format!("gaps-epochs-unit-{}.tsv", std::process::id()));
    std::fs::write(&path, text.join("\n")).expect("write");
    let spec = DataSpec::Files(vec![path.clone()]);
    // 45 training lines (lines 0, 10, ... are held out), two passes, batches of 20: 20, 20, 20, 20, 10.
    let mut stream = TrainingStream::new(&spec, 0, 1).and_then(|s| s.with_epochs(Some(2))).expect("stream");
    let mut sizes = Vec::new();
    loop {
        let batch = stream.next_batch(20).expect("batch");
        if batch.is_empty() {
            break;
        }
        sizes.push(batch.len());
    }
    let _ = std::fs::remove_file(&path);
    assert_eq!(sizes, [20, 20, 20, 20, 10]);
    assert_eq!((stream.passes(), stream.epochs_done()), (2, 2.0));
    let synthetic = TrainingStream::new(&DataSpec::Synthetic { seed: 1 }, 0, 1).expect("stream");
    let err = synthetic.with_epochs(Some(1)).expect_err("synthetic data has no passes");
    assert!(err.contains("--steps"), "{err}");
}

#[test]
fn dealt_splits_read_the_lines_a_whole_pass_reads_and_a_changed_file_is_an_error_naming_it() {
    let data = SyntheticCriteo::new(4);
    let lines: Vec<String> = (0..95).map(|i| SyntheticCriteo::to_line(&data.sample(i).0)).collect();
    let text = lines.join("\n") + "\n";
    let path = std::env::temp_dir().join(format!("gaps-split-unit-{}.tsv", std::process::id()));
    std::fs::write(&path, &text).expect("write");
    // Cut at every 30th line end, as the coordinator does: lines 1-30, 31-60, 61-90, 91-95.
    let ends: Vec<usize> = text.match_indices('\n').map(|(i, _)| i + 1).collect();
    let cuts =
        [(1u64, 0usize, ends[29]), (31, ends[29], ends[59]), (61, ends[59], ends[89]), (91, ends[89], text.len())];
    let mut dealt = Vec::new();
    for (first, start, end) in cuts {
        let mut split = SplitSamples::file(&path, first, start as u64, end as u64).expect("split");
        loop {
            let batch = split.next_batch(7).expect("batch");
            if batch.is_empty() {
                break;
            }
            dealt.extend(batch);
        }
    }
    let mut whole = TrainingStream::new(&DataSpec::Files(vec![path.clone()]), 0, 1)
        .and_then(|s| s.with_epochs(Some(1)))
        .expect("stream");
    let all = whole.next_batch(1000).expect("pass");
    assert_eq!(dealt.len(), 95 - 9, "every 10th line held out");
    assert_eq!(dealt, all, "the same samples in the same order");
    // The file shrinks under a split being read: an error naming it.
    let mut split = SplitSamples::file(&path, 61, ends[59] as u64, ends[89] as u64).expect("split");
    split.next_batch(2).expect("the first lines");
    std::fs::write(&path, &text[..ends[69]]).expect("truncate");
    let mut outcome = Ok(vec![]);
    for _ in 0..30 {
        outcome = split.next_batch(2);
        if outcome.as_ref().map_or(true, Vec::is_empty) {
            break;
        }
    }
    let err = outcome.expect_err("a shrunk file");
    assert!(err.contains(&path.display().to_string()) && err.contains("changed"), "{err}");
    // A split past the end of the (now shorter) file, and a file that is gone: errors naming it.
    let err = SplitSamples::file(&path, 91, ends[89] as u64, text.len() as u64).expect_err("past the end");
    assert!(err.contains(&path.display().to_string()), "{err}");
    std::fs::remove_file(&path).expect("remove");
    let err = SplitSamples::file(&path, 1, 0, ends[29] as u64).expect_err("gone");
    assert!(err.contains(&path.display().to_string()), "{err}");
}

#[test]
fn auc_of_known_cases() {
    assert_eq!(auc(&[0.1, 0.9], &[0, 1]), 1.0);
    assert_eq!(auc(&[0.9, 0.1], &[0, 1]), 0.0);
    assert_eq!(auc(&[0.5, 0.5], &[0, 1]), 0.5);
    assert!((auc(&[0.1, 0.4, 0.35, 0.8], &[0, 0, 1, 1]) - 0.75).abs() < 1e-12);
}

#[test]
fn the_teachers_weights_held_ahead_draw_the_same_samples_as_weights_computed_per_sample() {
    let held = SyntheticCriteo::new(17);
    assert!(held.weights.is_some(), "the default vocabularies hold their weights");
    let computed = SyntheticCriteo { weights: None, ..held.clone() };
    for i in 0..3000 {
        let ((a, pa), (b, pb)) = (held.sample(i), computed.sample(i));
        assert_eq!((a, pa.to_bits()), (b, pb.to_bits()), "sample {i}");
    }
    // Past the bound the weights are computed per sample.
    assert!(SyntheticCriteo::with_vocab(1, 2_000_000, 1.2).weights.is_none());
}

#[test]
fn a_shared_dataset_is_made_once_per_seed() {
    let (a, b) = (SyntheticCriteo::shared(23), SyntheticCriteo::shared(23));
    assert!(std::sync::Arc::ptr_eq(&a, &b), "made twice");
    let other = SyntheticCriteo::shared(24);
    assert_ne!(other.sample(0).0, a.sample(0).0, "another seed, another dataset");
    assert_eq!(a.sample(7), SyntheticCriteo::new(23).sample(7));
}
