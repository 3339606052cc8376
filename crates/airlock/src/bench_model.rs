pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("todo")
}
#[derive(clap::Args, Debug)]
pub struct Args {}
