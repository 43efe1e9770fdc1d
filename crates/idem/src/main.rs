//! `idem`: the idempotency gateway in front of any HTTP service, a payments demo, and the
//! operations CLI for idempotency stores. See `idem --help`.
#![allow(clippy::print_stdout, clippy::print_stderr)] // a command-line program: output is the point

use std::process::ExitCode;

use idem::cli::{Cli, Command};
use idem::consume;

/// mimalloc instead of the C library's allocator: a gateway request makes about seventy short
/// allocations (headers, bodies, futures, the record), and glibc's `malloc` and `free` were an
/// eighth of its instructions. A well-kept crate, a small C build with no system dependency.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // The sources `--from` takes are the brokers this build has: their examples come from the
    // registry, not from a paragraph written by hand.
    let command = <Cli as clap::CommandFactory>::command()
        .mut_subcommand("consume", |consume| consume.after_help(consume::sources_help()));
    // `IDEM_STORE_FILE` and the other secrets' files, read as their variables would be.
    let (command, secrets) = match idem::flags::secrets_from_files(command, &|name| std::env::var_os(name)) {
        Ok(read) => read,
        Err(error) => clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{error}\n")).exit(),
    };
    // `idem serve --config FILE`: the file's settings where no flag or variable gives one.
    let merged = match idem::config_file::merge(&command, std::env::args_os().collect(), &secrets) {
        Ok(merged) => merged,
        Err(error) => {
            eprintln!("idem: error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&merged.matches) {
        Ok(cli) => cli,
        Err(error) => error.exit(),
    };
    if let Command::Serve(config) = &mut cli.command {
        if let Some(file) = &merged.file {
            config.routes.clone_from(&file.routes);
            config.reload_args = Some(std::env::args_os().collect());
        }
        if let Err(conflict) = config.check() {
            clap::Error::raw(clap::error::ErrorKind::ArgumentConflict, format!("{conflict}\n")).exit();
        }
        if config.check {
            if let Some(serve) = command.find_subcommand("serve") {
                print!("{}", idem::config_file::report(&merged, serve));
            }
            return ExitCode::SUCCESS;
        }
        for warning in merged.file.iter().flat_map(|file| &file.warnings) {
            eprintln!("idem: warning: {warning}");
        }
    }
    let telemetry = idem::telemetry::init_logging(cli.command.log_level(), cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("idem: error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(idem::cli::run(cli.command));
    // The spans still waiting go out before the exit.
    telemetry.shutdown();
    match result {
        Ok(output) => {
            print!("{output}");
            if !output.is_empty() && !output.ends_with('\n') {
                println!();
            }
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("idem: error: {error}");
            ExitCode::FAILURE
        }
    }
}
