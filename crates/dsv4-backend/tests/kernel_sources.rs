//! Checks on the CUDA sources that need no GPU (they run in CI, where the cuda feature only
//! compiles): slips of this kind otherwise show only as a panic on the device.
//! - Every kernel's parameter count fits the launch builder (`MAX_ARGS` in cuda/launch.rs).
//! - Every kernel name a launcher asks `quant.cu`'s table for (`qk.of("…"`, `qk.get("…")`) is
//!   among the names `QuantKernels::load` loads (a missing one is a HashMap panic at launch).
//! - In `Kernels::load`, each module's `compile(ctx, i, &[names])` list and its `n(&mut var)`
//!   field assignments name the same kernels in the same order (`n` takes them in list order).
//! - Every name in those lists is defined in its kernel file.

use std::collections::BTreeMap;

const KDIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda");

fn read(rel: &str) -> String {
    std::fs::read_to_string(format!("{KDIR}/{rel}")).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// (name, parameter count) of every `__global__` function in `src`, macro-defined ones by
/// their name pattern (`gemv1x_##N`).
fn kernels(src: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find("__global__") {
        rest = &rest[i + "__global__".len()..];
        let Some(open) = rest.find('(') else { break };
        let mut head = rest[..open].trim().to_string();
        // `void __launch_bounds__(…) name(`: skip the bounds' parentheses.
        let mut params_from = open;
        if head.contains("__launch_bounds__") {
            let close = rest[open..].find(')').map(|c| open + c).unwrap();
            let next = rest[close..].find('(').map(|c| close + c).unwrap();
            head = rest[close + 1..next].trim().to_string();
            params_from = next;
        }
        let name = head.split_whitespace().last().unwrap_or("").to_string();
        let mut depth = 0;
        let mut commas = 0;
        let mut end = params_from;
        for (j, ch) in rest[params_from..].char_indices() {
            match ch {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = params_from + j;
                        break;
                    }
                }
                ',' if depth == 1 => commas += 1,
                _ => {}
            }
        }
        let params = rest[params_from + 1..end].trim().trim_end_matches('\\').trim();
        let n = if params.is_empty() { 0 } else { commas + 1 };
        out.push((name, n));
        rest = &rest[end..];
    }
    out
}

fn max_args() -> usize {
    let src = read("launch.rs");
    let line = src.lines().find(|l| l.starts_with("const MAX_ARGS: usize =")).expect("MAX_ARGS in launch.rs");
    line.trim_start_matches("const MAX_ARGS: usize =").trim().trim_end_matches(';').parse().unwrap()
}

const FILES: [&str; 9] = [
    "kernels/dense.cu",
    "kernels/hc.cu",
    "kernels/attention.cu",
    "kernels/moe.cu",
    "kernels/bf16.cu",
    "kernels/quant.cu",
    "kernels/gemm.cu",
    "kernels/dspark.cu",
    "kernels/draw.cu",
];

#[test]
fn every_kernel_fits_the_launch_builder() {
    let max = max_args();
    let mut seen = 0;
    for f in FILES {
        for (name, n) in kernels(&read(f)) {
            seen += 1;
            assert!(n <= max, "{f}: kernel {name} takes {n} arguments, the launch builder {max} (MAX_ARGS)");
        }
    }
    assert!(seen > 50, "found only {seen} kernels: the parser lost its way");
}

/// The string literals that follow `pat` in `src` (`qk.of("gemv1x"` → `gemv1x`).
fn literals_after(src: &str, pat: &str) -> Vec<String> {
    src.match_indices(pat).map(|(i, _)| src[i + pat.len()..].split('"').next().unwrap().to_string()).collect()
}

#[test]
fn every_quant_kernel_a_launcher_names_is_loaded() {
    let q = read("quant.rs");
    let start = q.find("let mut names = vec![").expect("QuantKernels::load's name list");
    let end = start + q[start..].find("let mut m = HashMap::new();").expect("end of the name list");
    let list = &q[start..end];
    let mut asked = Vec::new();
    for f in ["quant.rs", "bf16.rs", "gemm.rs", "mod.rs", "moe.rs", "attention.rs"] {
        let src = read(f);
        asked.extend(literals_after(&src, "qk.of(\"").into_iter().map(|n| (f, n)));
        asked.extend(literals_after(&src, "qk.get(\"").into_iter().map(|n| (f, n)));
        asked.extend(literals_after(&src, ".of(if four { \"").into_iter().map(|n| (f, n)));
    }
    assert!(asked.len() > 5, "found only {} kernel names asked for", asked.len());
    for (f, name) in asked {
        assert!(
            list.contains(&format!("\"{name}\"")),
            "{f} asks quant.cu's table for {name}, which load() never loads"
        );
    }
    // The grouped kernel of four outputs a warp is chosen by an `if` the pattern above skips.
    for name in ["gemv1x4", "gemv1xg4", "gemv1xg", "gemv1xq"] {
        assert!(list.contains(&format!("\"{name}\"")), "{name} is not loaded");
    }
}

#[test]
fn kernel_lists_and_fields_agree() {
    let m = read("mod.rs");
    let load = &m[m.find("impl Kernels {").expect("impl Kernels")..];
    let load = &load[..load.find("\n}\n").unwrap_or(load.len())];
    // Module variable → (file index, names in compile order).
    let mut lists: BTreeMap<String, (usize, Vec<String>)> = BTreeMap::new();
    for (i, _) in load.match_indices("= compile(") {
        let var = load[..i].trim_end().rsplit(' ').next().unwrap().to_string();
        let call = &load[i..];
        let args = &call[..call.find(")?").unwrap()];
        let idx: usize = args.split(',').nth(1).unwrap().trim().parse().unwrap();
        // Every quote starts a piece: the names are every other one (opening quotes).
        let names: Vec<String> = literals_after(args, "\"").into_iter().step_by(2).collect();
        lists.insert(var, (idx, names));
    }
    assert!(lists.len() >= 4, "found {} compile lists", lists.len());
    let mut fields: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in load.lines() {
        let l = line.trim();
        if let Some((field, rest)) = l.split_once(": n(&mut ") {
            let var = rest.trim_end_matches("),").trim_end_matches(')').to_string();
            fields.entry(var).or_default().push(field.trim().to_string());
        }
    }
    let sources = [
        "kernels/dense.cu",
        "kernels/hc.cu",
        "kernels/attention.cu",
        "kernels/moe.cu",
        "kernels/bf16.cu",
        "kernels/draw.cu",
    ];
    for (var, (idx, names)) in &lists {
        let got = fields.get(var).cloned().unwrap_or_default();
        assert_eq!(&got, names, "module `{var}`: the fields taken with n(&mut {var}) must follow its compile list");
        let defined: Vec<String> = kernels(&read(sources[*idx])).into_iter().map(|k| k.0).collect();
        for n in names {
            assert!(defined.contains(n), "{}: no kernel {n} (compile list `{var}`)", sources[*idx]);
        }
    }
}
