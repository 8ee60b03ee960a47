//! Unit tests of the CUDA mover's planning (no GPU needed) and its clean failure without a driver.
#![allow(clippy::unwrap_used)]

use super::*;

#[test]
fn coalesce_merges_only_contiguous_runs() {
    let v = vec![
        Copy {
            src: 0,
            dst: 100,
            len: 10,
        },
        Copy {
            src: 10,
            dst: 110,
            len: 10,
        },
        Copy {
            src: 20,
            dst: 200,
            len: 10,
        },
        Copy {
            src: 30,
            dst: 210,
            len: 5,
        },
    ];
    assert_eq!(
        coalesce(v),
        vec![
            Copy {
                src: 0,
                dst: 100,
                len: 20
            },
            Copy {
                src: 20,
                dst: 200,
                len: 15
            }
        ]
    );
}

#[test]
fn flatten_places_chunks_in_canonical_order() {
    let items = vec![(
        0usize,
        vec![Chunk { addr: 1000, len: 4 }, Chunk { addr: 5000, len: 6 }],
        64usize,
    )];
    let f = flatten(&items, CopyDir::DeviceToHost);
    assert_eq!(
        f,
        vec![
            Copy {
                src: 1000,
                dst: 64,
                len: 4
            },
            Copy {
                src: 5000,
                dst: 68,
                len: 6
            }
        ]
    );
    let b = flatten(&items, CopyDir::HostToDevice);
    assert_eq!(
        b[1],
        Copy {
            src: 68,
            dst: 5000,
            len: 6
        }
    );
}

#[test]
fn a_round_places_each_blocks_chunks_in_its_staging_slot() {
    // Two blocks of 10 bytes (chunks of 4 + 6), host blocks contiguous at 640 and 650.
    let items = vec![
        (
            0usize,
            vec![Chunk { addr: 1000, len: 4 }, Chunk { addr: 5000, len: 6 }],
            640usize,
        ),
        (
            1usize,
            vec![Chunk { addr: 2000, len: 4 }, Chunk { addr: 6000, len: 6 }],
            650usize,
        ),
    ];
    let (d, copies) = round(&items, 100, 10, CopyDir::DeviceToHost);
    // Gather: engine chunk -> slot k of the half at 100, in canonical order.
    assert_eq!(
        d,
        vec![1000, 100, 4, 5000, 104, 6, 2000, 110, 4, 6000, 114, 6]
    );
    // The two slots and the two host blocks are both contiguous: one copy.
    assert_eq!(
        copies,
        vec![Copy {
            src: 100,
            dst: 640,
            len: 20
        }]
    );
    let (d, copies) = round(&items, 100, 10, CopyDir::HostToDevice);
    assert_eq!(&d[..6], &[100, 1000, 4, 104, 5000, 6]);
    assert_eq!(
        copies,
        vec![Copy {
            src: 640,
            dst: 100,
            len: 20
        }]
    );
}

/// Compiles the gather/scatter kernel where NVRTC is installed (no GPU needed).
#[test]
fn kernel_compiles_with_nvrtc() {
    if !cu::nvrtc_present() {
        eprintln!("NVRTC not installed: skipping");
        return;
    }
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL_SRC).unwrap();
    assert!(ptx.to_src().contains(".entry kvtier_copy_chunks("));
    // The embedded fallback is the same compiler output (modulo its header comment).
    let body = |p: &str| {
        p.lines()
            .filter(|l| !l.starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        body(&ptx.to_src()),
        body(KERNEL_PTX),
        "regenerate copy_kernel.ptx"
    );
    if let Ok(p) = std::env::var("KVTIER_DUMP_PTX") {
        std::fs::write(p, ptx.to_src()).unwrap();
    }
}

#[test]
fn cuda_engine_without_driver_is_a_clean_error() {
    if cu::library_present() {
        eprintln!("CUDA present: skipping the no-driver check");
        return;
    }
    let l = crate::StridedLayout::contiguous(crate::DevicePtr::new(4096).unwrap(), 2, 64).unwrap();
    let r = CudaMover::new(0, &l, None, CudaCopyMethod::Auto, LayeredCopy::Auto);
    assert!(matches!(r, Err(IoError::Cuda(_))));
}

/// The job descriptor buffer is allocated with the engine, big enough for a 32K prompt of an
/// 8B-shaped model, so no load of that size grows it (a growth frees the old buffer, and
/// cuMemFreeHost waits for the whole device).
#[test]
fn the_job_descriptor_buffer_fits_a_32k_prompt_from_the_start() {
    use crate::transfer::layout::StridedLayout;
    // Llama-3.1-8B shape, vLLM per-layer layout: 32 layers, 16-token blocks of 32 KiB per K or V
    // plane (2 MiB a block), 50,000 blocks of G1.
    let bases: Vec<crate::transfer::memory::DevicePtr> = (0..32u64)
        .map(|l| crate::transfer::memory::DevicePtr::new(0x1_0000_0000 + l * (4 << 30)).unwrap())
        .collect();
    let big = StridedLayout::kv_per_layer(&bases, 50_000, 32 << 10).unwrap();
    let n = initial_job_descs(&big);
    // A 32K prompt: 2,048 blocks, each cut into at most its 64 chunks and 32 layers.
    assert!(n >= 2048 * (64 + 32) * 24, "{n} bytes");
    assert!(n <= 16 << 20, "{n} bytes");
    // A tiny cache gets the floor, not a 4 GiB-of-blocks buffer.
    let tiny = StridedLayout::kv_per_layer(&bases[..4], 16, 4096).unwrap();
    assert_eq!(initial_job_descs(&tiny), 64 << 10);
    // Many small blocks: capped.
    let many = StridedLayout::kv_per_layer(&bases, 1_000_000, 64).unwrap();
    assert_eq!(initial_job_descs(&many), 16 << 20);
}
